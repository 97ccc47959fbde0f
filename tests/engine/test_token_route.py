"""engine/token_route.py: one route for every runner; who picks (device or HostPicks) and what the route feeds.

The route's tokens are checked against a loop written here from the runner's logits and Sampler.pick, the
host sampler's own step (penalties, grammar, philox draws, logprobs): the route must add nothing of its own.
"""
import numpy as np
import pytest

from ninfer_numba import LLM, SamplingParams
from ninfer_numba.engine.sampling import Sampler
from ninfer_numba.engine.token_route import HostPicks, picker_for, token_steps
from tests.engine.test_sampling import DeviceEmulatingRunner

PROMPT = [3, 3, 17, 200, 17, 9]


def _route(runner, sampler, n: int, prompt=PROMPT) -> list[int]:
    steps = token_steps(runner, sampler, list(prompt), runner.model.config.n_vocab)
    return [next(steps) for _ in range(n)]


def _by_hand(runner, sampler, n: int, prompt=PROMPT) -> list[int]:
    toks = [sampler.pick(runner.prefill(list(prompt)))]
    while len(toks) < n:
        toks.append(sampler.pick(runner.decode(toks[-1])))
    return toks


@pytest.mark.parametrize("cfg", [dict(temperature=0.0), dict(temperature=0.0, logprobs=3),
                                 dict(temperature=0.9, top_k=20, seed=5, logprobs=0),
                                 dict(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5, seed=1)],
                         ids=["greedy", "greedy-logprobs", "sampled-logprobs", "two-windows"])
def test_the_cpu_runner_picks_on_the_host_as_the_sampler_does(tiny_novocab, cfg):
    params = SamplingParams(max_tokens=10, ignore_eos=True, **cfg)
    llm = LLM(tiny_novocab, backend="cpu")
    V = llm.config.n_vocab
    a = Sampler(params, V, PROMPT)
    assert isinstance(picker_for(llm.runner, a, a.device_window()), HostPicks)
    route = _route(llm.runner, a, 10)
    llm.runner.reset()
    b = Sampler(params, V, PROMPT)
    assert route == _by_hand(llm.runner, b, 10)
    assert a.step == b.step == 10 and np.array_equal(a.counts, b.counts)
    assert [(r.token, r.logprob, r.top) for r in a.logprob_log] == [(r.token, r.logprob, r.top)
                                                                   for r in b.logprob_log]
    assert len(a.logprob_log) == (10 if params.logprobs is not None else 0)


def test_who_picks(tiny_novocab):
    llm = LLM(tiny_novocab, backend="cpu")
    device = DeviceEmulatingRunner(llm.weights, llm.max_seq)
    V = llm.config.n_vocab

    def picker(runner, **cfg):
        s = Sampler(SamplingParams(**cfg), V, PROMPT)
        return picker_for(runner, s, s.device_window())

    assert picker(device, temperature=0.7, repetition_penalty=1.1) is device
    assert picker(device, temperature=0.0, logprobs=2) is device
    assert isinstance(picker(device, temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.3), HostPicks)
    device.supports_device_logprobs = False
    assert isinstance(picker(device, temperature=0.0, logprobs=2), HostPicks)
    assert picker(device, temperature=0.0) is device


class _GreedyCountingRunner(DeviceEmulatingRunner):
    """Counts the argmax-only steps (decode_greedy): the plain greedy route on a runner without device
    sampling must take them and copy no logits back."""
    supports_device_sampling = False
    greedy_steps = 0

    def decode_greedy(self, token):
        self.greedy_steps += 1
        return super().decode_greedy(token)


def test_plain_greedy_on_the_host_reads_back_only_tokens(tiny_novocab):
    llm = LLM(tiny_novocab, backend="cpu")
    r = _GreedyCountingRunner(llm.weights, llm.max_seq)
    s = Sampler(SamplingParams(temperature=0.0), llm.config.n_vocab, PROMPT)
    toks = _route(r, s, 6)
    assert r.greedy_steps == 5 and s.step == 6
    r.reset()
    assert toks == _by_hand(r, Sampler(SamplingParams(temperature=0.0), llm.config.n_vocab, PROMPT), 6)


def test_the_route_ends_with_the_device_run_ahead(tiny_novocab):
    """run_ahead ends when the context is full: the route ends there too, without a step past it."""
    llm = LLM(tiny_novocab, backend="cpu")
    r = DeviceEmulatingRunner(llm.weights, llm.max_seq)
    base = r.run_ahead
    r.run_ahead = lambda first, **kw: (t for _, t in zip(range(3), base(first, **kw)))
    s = Sampler(SamplingParams(temperature=0.0), llm.config.n_vocab, PROMPT)
    assert len(list(token_steps(r, s, list(PROMPT), llm.config.n_vocab))) == 4 and r.position == len(PROMPT) + 3
