"""A model split by layers (engine/sharded_runner.py) computes what the whole model computes: the shards
share one device here and cross through pinned host memory as between devices, so the logits are equal bit
for bit (the same kernels on the same numbers; a float32 hidden state copied, never rounded).

GPU: 1, 2 and 4 shards against the plain cuda runner, prefill in three chunks and greedy steps. Simulator:
the orchestration and the greedy steps' token hand-back with a stub model (the real forward takes minutes per
chunk there)."""
import numpy as np
import pytest

from tests.gguf_factory import QT, tensors_for, write_gguf

def _file(tmp_path, spec):
    return write_gguf(tmp_path / "m.gguf", spec, tensors_for(spec, np.random.default_rng(21)), matrix_type=QT.Q8_0)


def _greedy(llm, prompt, n):
    from ninfer_numba import SamplingParams
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)).token_ids


class _StubModel:
    """Qwen35Gpu's interface with arithmetic anyone can follow: the embedding writes each token id across its
    row, layer i maps x to 2·x + i + 1 (order matters: a layer skipped, repeated or run out of order changes
    every value), the head copies the last rows of x into the logits' first n_embd columns."""

    def __init__(self, gw, engine, stream):
        from types import SimpleNamespace

        from ninfer_numba.kernels.numba_env import cuda
        self.gw, self.stream, self.gemm_path = gw, stream, "stub"
        e, t_max = gw.config.n_embd, engine.prefill_chunk
        self.buf = SimpleNamespace(t_max=t_max, tokens=cuda.device_array(t_max, np.int32),
                                   x=cuda.device_array(t_max * e, np.float32))
        self.logits = cuda.device_array((t_max, e), np.float32)

    def new_state(self, max_seq):
        class State:
            host_pos = 0

            def reset(self, stream):
                self.host_pos = 0
        return State()

    def forward(self, t, st, logits_rows=1):
        e = self.gw.config.n_embd
        x = self.buf.x[:t * e].copy_to_host().reshape(t, e).astype(np.float64)
        if self.gw.embedding:
            x = np.repeat(self.buf.tokens[:t].copy_to_host()[:, None], e, axis=1).astype(np.float64)
        for i in self.gw.layers:
            x = 2 * x + i + 1
        self.buf.x[:t * e].copy_to_device(x.astype(np.float32).ravel())
        if self.gw.head:
            self.logits[:logits_rows].copy_to_device(x[t - logits_rows:].astype(np.float32))
        st.host_pos += t


def _stub_value(token, n_layer):
    x = float(token)
    for i in range(n_layer):
        x = 2 * x + i + 1
    return x


def _stub_shards(monkeypatch, model_class) -> None:
    """Under the simulator only (the GPU runs test_shards_equal_the_cuda_runner): the sharded runner builds
    model_class shards on weights that name their layers and hold nothing."""
    from types import SimpleNamespace

    from ninfer_numba.engine import sharded_runner
    from ninfer_numba.kernels.numba_env import SIMULATOR
    if not SIMULATOR:
        pytest.skip("simulator test (the GPU runs test_shards_equal_the_cuda_runner)")

    def weights(w, *, layers, embedding, head, log=None):
        return SimpleNamespace(config=w.config, layers=list(layers), embedding=embedding, head=head)
    monkeypatch.setattr(sharded_runner, "GpuWeights", weights)
    monkeypatch.setattr(sharded_runner, "Qwen35Gpu", model_class)


@pytest.mark.cudasim
def test_the_chain_of_shards_hands_every_chunk_through(tiny_novocab, monkeypatch):
    """The orchestration alone, under the simulator (the real forward there takes minutes per chunk; the GPU
    test below checks it): 3 shards on one device, 7 tokens in chunks of 3, 3, 1 (both bridge parities, a
    short last chunk), then decode steps: each shard's layers run once, in order, on its chunk."""
    from ninfer_numba import LLM
    _stub_shards(monkeypatch, _StubModel)
    llm = LLM(tiny_novocab, backend="cuda", max_seq=16, prefill_chunk=3, gpus="0,0,0")
    runner, n = llm.runner, llm.config.n_layer
    assert [list(s.layers) for s in runner.plan] == [[0], [1, 2], [3]]      # the tied head weighs on the last
    ids = [5, 1, 7, 2, 9, 4, 3]
    rows = runner.all_logits(ids)
    want = np.array([_stub_value(t, n) for t in ids])
    np.testing.assert_array_equal(rows[:, 0], want.astype(np.float32))
    assert (rows == rows[:, :1]).all() and runner.position == len(ids)
    for tok in (6, 8):
        assert runner.decode(tok)[0] == np.float32(_stub_value(tok, n))
    assert runner.position == len(ids) + 2 and all(w.state.host_pos == 9 for w in runner.workers)
    runner.reset()
    assert runner.position == 0


class _PickStub(_StubModel):
    """_StubModel whose logits rows give the argmax a meaning: row r peaks at column x_r mod 61 (x_r the
    value the stub's head copies)."""

    def forward(self, t, st, logits_rows=1):
        super().forward(t, st, logits_rows)
        if self.gw.head:
            x = self.logits[:logits_rows].copy_to_host()[:, :1].astype(np.int64)
            ramp = -np.abs(np.arange(self.logits.shape[1]) - x % 61)
            self.logits[:logits_rows].copy_to_device(ramp.astype(np.float32))


@pytest.mark.cudasim
@pytest.mark.parametrize("gpus", ["0,", "0,0"])
def test_greedy_steps_feed_the_device_pick_back(tiny_novocab, monkeypatch, gpus):
    """decode_greedy under the simulator (eager steps: the graphs are GPU-only): one shard's argmax lands in
    its own token buffer, so a step fed that pick uploads nothing; with two shards every token goes up
    through the host. A token other than the last pick, or one after a prefill, is uploaded either way."""
    from ninfer_numba import LLM
    _stub_shards(monkeypatch, _PickStub)
    runner = LLM(tiny_novocab, backend="cuda", max_seq=16, prefill_chunk=3, gpus=gpus).runner
    n, one = runner.config.n_layer, gpus == "0,"
    assert len(runner.workers) == (1 if one else 2)
    uploads, upload = [], runner._upload
    monkeypatch.setattr(runner, "_upload", lambda ids: (uploads.append([int(i) for i in ids]), upload(ids)))

    def pick(tok):
        return int(_stub_value(tok, n)) % 61
    runner.prefill([5, 1, 7])
    a = runner.decode_greedy(5)
    b = runner.decode_greedy(a)
    c = runner.decode_greedy(9)
    d = runner.decode_greedy(c)
    assert [a, b, c, d] == [pick(5), pick(a), pick(9), pick(c)] and len({5, a, b, 9, c, d}) == 6
    assert uploads[1:] == ([[5], [9]] if one else [[5], [a], [9], [c]])
    assert runner.position == 7 and all(w.state.host_pos == 7 for w in runner.workers)
    runner.prefill([3, d])                   # the buffer now starts with 3: d must go up again
    assert runner.decode_greedy(d) == pick(d) and uploads[-1] == [d] and runner.position == 10


@pytest.mark.gpu
def test_shards_equal_the_cuda_runner(tmp_path):
    from ninfer_numba import LLM
    from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
    from tests.model.test_gpu_model import SPEC
    if SIMULATOR or not gpu_available():
        pytest.skip("needs a CUDA GPU")
    path = _file(tmp_path, SPEC)
    prompt = np.random.default_rng(3).integers(0, SPEC.n_vocab, 70).tolist()      # chunks of 32, 32, 6
    whole = LLM(path, backend="cuda", max_seq=96, prefill_chunk=32, prefix_cache_mb=0)
    want_logits, want_tokens = whole.logits(prompt), _greedy(whole, prompt, 8)
    for gpus in ("0,", "0,0", "0,0,0,0"):      # one shard: its pick fed back without an upload
        llm = LLM(path, backend="cuda", max_seq=96, prefill_chunk=32, gpus=gpus)
        np.testing.assert_array_equal(llm.logits(prompt), want_logits)
        assert _greedy(llm, prompt, 8) == want_tokens
