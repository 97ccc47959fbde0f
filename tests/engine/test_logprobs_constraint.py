"""Host picks for grammars and logprobs (engine/sampling.py, engine/llm.py) on the CPU backend.

The grammar here is a scripted one (a fixed token sequence, then the end-of-turn token), so these tests
check the sampler's masking and bookkeeping apart from llguidance (tests/engine/test_constraint.py).
"""
import numpy as np
import pytest

from ninfer_numba.config import SamplingParams
from ninfer_numba.engine.llm import LLM
from ninfer_numba.engine.sampling import token_logprob

PROMPT = [5, 17, 200, 9, 31, 64, 2, 77]


class ScriptedConstraint:
    """Allows exactly the next token of ``script``; records what it was advanced with."""

    def __init__(self, script, n_vocab):
        self.script, self.n_vocab, self.seen = list(script), n_vocab, []

    def allowed(self):
        mask = np.zeros(self.n_vocab, bool)
        mask[self.script[len(self.seen)]] = True
        return mask

    def bitmask(self, n_vocab):
        bits = np.zeros(-(-n_vocab // 32) * 32, bool)
        bits[:self.n_vocab] = self.allowed()
        return np.packbits(bits, bitorder="little").view(np.int32)

    def advance(self, token):
        if token != self.script[len(self.seen)]:
            raise ValueError(f"token {token} is not allowed")
        self.seen.append(token)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, backend="cpu", max_seq=128)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=0.0),
                                    SamplingParams(max_tokens=8, temperature=1.0, top_k=5, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_grammar_decides_every_token(llm, params):
    eos = min(llm.tokenizer.eos_ids)
    script = [1000, 2000, 3000, eos]
    c = ScriptedConstraint(script, llm.config.n_vocab)
    out = llm.generate(PROMPT, params, constraint=c)
    assert out.token_ids == script and c.seen == script and out.finish_reason == "stop"


@pytest.mark.gpu
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=0.0),
                                    SamplingParams(max_tokens=8, temperature=1.0, top_k=5, seed=3),
                                    SamplingParams(max_tokens=8, temperature=0.8, repetition_penalty=1.3, seed=4)],
                         ids=["greedy", "sampled", "penalty"])
def test_gpu_device_draws_under_the_grammar(tmp_path, params):
    """The cuda runner draws on the device under the packed mask, one step at a time; the script's tokens
    (the best ones never among them) are the only ones allowed, so the output must be the script."""
    from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
    if SIMULATOR or not gpu_available():
        pytest.skip("needs a CUDA GPU")
    from tests.gguf_factory import QT, tensors_for, write_gguf
    from tests.model.test_gpu_model import SPEC
    path = write_gguf(tmp_path / "tiny-gpu.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(21)),
                      matrix_type=QT.Q8_0)
    llm = LLM(path, backend="cuda", max_seq=64, prefill_chunk=32)
    script = [7, 100, 3, 250, 11, 42, 9, 1]
    c = ScriptedConstraint(script, llm.config.n_vocab)
    out = llm.generate(PROMPT, params, constraint=c)
    assert out.token_ids == script and c.seen == script


def test_logprobs_are_the_models_log_softmax(llm):
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
    out = llm.generate(PROMPT, params)
    assert len(out.logprobs) == len(out.token_ids) == 5
    fresh = llm.logits(PROMPT + out.token_ids[:-1])[len(PROMPT) - 1:]
    for entry, row, tok in zip(out.logprobs, fresh, out.token_ids):
        ref = row.astype(np.float64) - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert entry.token == tok
        np.testing.assert_allclose(entry.logprob, ref[tok], atol=1e-4)
        assert [t for t, _ in entry.top] == np.argsort(-ref, kind="stable")[:3].tolist()
        assert entry.top[0][0] == tok                      # greedy: the chosen token is the most likely
        np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(ref)[::-1][:3], atol=1e-4)


def test_logprobs_off_records_nothing(llm):
    assert llm.generate(PROMPT, SamplingParams(max_tokens=3)).logprobs == ()


def test_token_logprob_zero_top_and_ties():
    x = np.array([1.0, 3.0, 3.0, -np.inf, 0.5], np.float32)
    e = token_logprob(x, 2, 0)
    assert e.top == () and np.isclose(np.exp(e.logprob), np.exp(3) / (np.exp(1) + 2 * np.exp(3) + np.exp(0.5)))
    assert [t for t, _ in token_logprob(x, 0, 3).top] == [1, 2, 0]
    assert token_logprob(x, 3, 1).logprob == -np.inf


def test_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_token_logprob_ties_at_the_cut_take_the_lower_ids():
    x = np.zeros(1000, np.float32)
    x[[700, 3]] = 1.0
    assert [t for t, _ in token_logprob(x, 5, 4).top] == [3, 700, 0, 1]


@pytest.mark.gpu
def test_gpu_device_logprobs_equal_the_host_ones(tmp_path, monkeypatch):
    """Greedy: the device's records (kernels/sample/logprobs.py, through run_ahead) against token_logprob of
    the same decode graph's logits copied back (the host route, forced): same tokens, same top ids, the
    log-probabilities to float64 rounding. Sampled: each record is consistent with its own token."""
    from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
    if SIMULATOR or not gpu_available():
        pytest.skip("needs a CUDA GPU")
    from ninfer_numba.engine.cuda_runner import CudaRunner
    from tests.gguf_factory import QT, tensors_for, write_gguf
    from tests.model.test_gpu_model import SPEC
    path = write_gguf(tmp_path / "tiny-gpu.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(21)),
                      matrix_type=QT.Q8_0)
    llm = LLM(path, backend="cuda", max_seq=64, prefill_chunk=32)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5)
    device = llm.generate(PROMPT, greedy)
    monkeypatch.setattr(CudaRunner, "supports_device_logprobs", False)
    host = llm.generate(PROMPT, greedy)
    assert device.token_ids == host.token_ids and len(device.logprobs) == 10
    for d, h in zip(device.logprobs, host.logprobs):
        assert d.token == h.token and [t for t, _ in d.top] == [t for t, _ in h.top]
        np.testing.assert_allclose([d.logprob] + [v for _, v in d.top], [h.logprob] + [v for _, v in h.top],
                                   rtol=0, atol=1e-9)
    monkeypatch.setattr(CudaRunner, "supports_device_logprobs", True)
    sampled = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=5, logprobs=3))
    for e in sampled.logprobs:
        vals = [v for _, v in e.top]
        assert vals == sorted(vals, reverse=True) and e.logprob <= vals[0] + 1e-12
        if e.token in [t for t, _ in e.top]:
            assert e.logprob == dict(e.top)[e.token]
