"""The request sampler (engine/sampling.py) and the device-sampling dispatch of LLM.stream.

The device kernels read one penalty window; the host applies two (repetition over prompt + output,
presence/frequency over the output). ``DeviceEmulatingRunner`` stands in for the CUDA runner with the
device's arithmetic (kernels/sample/ref.py, the kernels' reference) on one window, so these CPU tests prove
that the window and parameters LLM.stream hands the device reproduce the host sampler token for token.
The real kernels are checked against sample_ref in tests/kernels/test_sample_kernel.py and end to end on
the GPU in tests/model/test_gpu_model.py.
"""
import numpy as np
import pytest

from ninfer_numba import LLM, SamplingParams
from ninfer_numba.engine.cpu_runner import CpuRunner
from ninfer_numba.engine.sampling import Sampler, token_logprob
from ninfer_numba.kernels.sample.ref import apply_mask_ref, apply_penalties_ref, philox_uniform, sample_ref


class DeviceEmulatingRunner(CpuRunner):
    """The cuda runner's sampling protocol on the CPU: device draws (the reference arithmetic), a grammar's
    packed mask, logprobs records (engine/sampling.py's token_logprob, which the device kernel matches)."""
    supports_device_sampling = True
    supports_device_logprobs = True

    def start_sampling(self, window, params):
        self.window, self.params, self.device_draws = window.copy(), dict(params), 0

    def start_logprobs(self, n_top):
        self.n_top = n_top

    def last_logprob(self, token):
        assert self.last.token == token
        return self.last

    def _pick(self, logits, mask=None, logprobs=False, sampled=True):
        if not sampled:
            tok = int(np.argmax(logits))
        else:
            p = self.params
            x = apply_penalties_ref(logits, self.window, p["repetition"], p["presence"], p["frequency"])
            if mask is not None:
                x = apply_mask_ref(x, mask)
            tok = sample_ref(x, p["temperature"], p["top_k"], p["top_p"], p["min_p"],
                             philox_uniform(p["seed"], p["step"]))
            p["step"] += 1                      # the kernel advances its draw counter
            self.window[tok] += 1               # update_counts
            self.device_draws += 1
        if logprobs:
            self.last = token_logprob(logits, tok, self.n_top)
        return tok

    def prefill_sampled(self, ids, mask=None, logprobs=False, sampled=True):
        logits = self.prefill(ids)                        # a mask function runs after the forward, as there
        return self._pick(logits, mask() if callable(mask) else mask, logprobs, sampled)

    def decode_sampled(self, token, mask=None, logprobs=False):
        logits = self.decode(token)
        return self._pick(logits, mask() if callable(mask) else mask, logprobs)

    def run_ahead(self, first, sampled=False, logprobs=False):
        """The CUDA runner's loop without the overlap: each step feeds back its own choice."""
        tok = first
        while True:
            tok = self._pick(self.decode(tok), logprobs=logprobs, sampled=sampled)
            yield tok


CASES = [
    dict(temperature=0.9, top_k=20, seed=5),
    dict(temperature=1.0, top_p=0.8, min_p=0.02, seed=6),
    dict(temperature=0.7, repetition_penalty=1.3, seed=7),
    dict(temperature=1.1, presence_penalty=0.8, frequency_penalty=0.5, seed=8),
    dict(temperature=0.0, repetition_penalty=1.5),
    dict(temperature=0.0, frequency_penalty=1.5),
    dict(temperature=0.0),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_device_path_equals_host_sampler(tiny_novocab, cfg):
    prompt = [3, 3, 17, 200, 17, 9]
    params = SamplingParams(max_tokens=12, ignore_eos=True, **cfg)
    host = list(LLM(tiny_novocab, backend="cpu").stream(prompt, params))
    llm = LLM(tiny_novocab, backend="cpu")
    llm.runner = DeviceEmulatingRunner(llm.weights, llm.max_seq)
    dev = list(llm.stream(prompt, params))
    assert dev == host
    plain = cfg == dict(temperature=0.0)
    assert getattr(llm.runner, "device_draws", 0) == (0 if plain else len(dev))


def test_both_penalty_windows_pick_on_the_host(tiny_novocab):
    params = SamplingParams(max_tokens=6, temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5,
                            seed=1, ignore_eos=True)
    assert Sampler(params, 16, [1, 2]).device_window() is None
    llm = LLM(tiny_novocab, backend="cpu")
    llm.runner = DeviceEmulatingRunner(llm.weights, llm.max_seq)
    out = list(llm.stream([5, 6, 7], params))
    assert len(out) == 6 and not hasattr(llm.runner, "device_draws")
    assert out == list(LLM(tiny_novocab, backend="cpu").stream([5, 6, 7], params))


def test_penalty_windows():
    """Repetition covers prompt and output; presence/frequency count generated tokens only."""
    V = 8
    logits = np.array([2.0, -1.0, 1.0, 0.5, 0.0, 3.0, -2.0, 1.5], np.float32)
    s = Sampler(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), V,
                prompt_ids=[0, 1])
    s.record(5)
    s.record(5)
    x = s.penalised(logits)
    np.testing.assert_array_equal(x[[0, 1]], np.float32([1.0, -2.0]))       # prompt: repetition only
    assert x[5] == np.float32(3.0 / 2.0 - 0.5 - 2 * 0.25)                      # output: both
    np.testing.assert_array_equal(x[[2, 3, 4, 6, 7]], logits[[2, 3, 4, 6, 7]])
    assert s.step == 2 and s.counts[5] == 2 and s.seen[5] == 1


def test_seeded_draws_follow_the_philox_stream():
    V = 50
    logits = np.random.default_rng(0).standard_normal(V).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=10, seed=123)
    a, b = Sampler(params, V), Sampler(params, V)
    picks = [a.pick(logits) for _ in range(20)]
    assert picks == [b.pick(logits) for _ in range(20)]
    expect = [sample_ref(logits, 0.8, 10, 1.0, 0.0, philox_uniform(123, n)) for n in range(20)]
    assert picks == expect and len(set(picks)) > 1
    unseeded = [Sampler(SamplingParams(temperature=1.0), V).seed for _ in range(3)]
    assert len(set(unseeded)) == 3


def test_greedy_takes_the_lowest_index_of_a_tie():
    s = Sampler(SamplingParams(), 4)
    assert s.is_plain_greedy and s.pick(np.float32([1.0, 3.0, 3.0, 0.0])) == 1
    assert not Sampler(SamplingParams(frequency_penalty=0.1), 4).is_plain_greedy


class OnlyEvenTokens:
    """A grammar that allows the even ids below 64 (a stand-in for engine/constraint.py's TokenConstraint)."""

    def __init__(self, n_vocab):
        self.mask = np.zeros(n_vocab, bool)
        self.mask[0:64:2] = True
        self.seen = []

    def allowed(self):
        return self.mask

    def bitmask(self, n_vocab):
        bits = np.zeros(-(-n_vocab // 32) * 32, bool)
        bits[:len(self.mask)] = self.mask
        return np.packbits(bits, bitorder="little").view(np.int32)

    def advance(self, token):
        assert self.mask[token], token
        self.seen.append(token)


@pytest.mark.parametrize("cfg", [dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=5),
                                 dict(temperature=0.7, repetition_penalty=1.3, seed=7)], ids=["greedy", "k20", "rep"])
@pytest.mark.parametrize("with_grammar", [False, True], ids=["free", "grammar"])
def test_device_logprobs_and_grammar_routes_equal_the_host(tiny_novocab, cfg, with_grammar):
    """With logprobs (and a grammar), the device route (records after each device pick, masked draws one step
    at a time) gives the host route's tokens and log-probabilities exactly."""
    prompt = [3, 3, 17, 200, 17, 9]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=4, **cfg)
    host_llm = LLM(tiny_novocab, backend="cpu")
    host_grammar = OnlyEvenTokens(host_llm.config.n_vocab) if with_grammar else None
    host = host_llm.generate(prompt, params, constraint=host_grammar)
    llm = LLM(tiny_novocab, backend="cpu")
    llm.runner = DeviceEmulatingRunner(llm.weights, llm.max_seq)
    grammar = OnlyEvenTokens(llm.config.n_vocab) if with_grammar else None
    dev = llm.generate(prompt, params, constraint=grammar)
    assert dev.token_ids == host.token_ids and dev.logprobs == host.logprobs and len(dev.logprobs) == 10
    if with_grammar:
        assert grammar.seen == dev.token_ids and all(t % 2 == 0 and t < 64 for t in dev.token_ids)
        assert llm.runner.device_draws == 10            # every token drawn on the device, under the mask
