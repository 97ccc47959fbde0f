"""Qwen35Gpu's mixers over packed parts (forward_packed's per-sequence kernels) under the CUDA simulator: a
Gated DeltaNet layer and an attention layer run on three sequences' rows in one call (3, 2 and 1 tokens: the
chunked prefill, and the one-token decode kernels) give each sequence's output and state as three separate
calls do. The matmuls' rows are independent (int8 products exact in int32), so the outputs are equal.
(The whole packed forward against the runner is a GPU test: tests/model/test_batched_decode.py.)"""
import numpy as np
import pytest


@pytest.mark.cudasim
def test_packed_mixers_equal_one_call_per_sequence():
    from ninfer_numba.kernels import position
    from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
    from tests.model.test_gpu_model import tiny_gpu_model
    if not SIMULATOR:
        pytest.skip("the simulator run of the mixers (the GPU runs test_packed_prefill_equals_the_runner)")
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_gpu_model(tmp, max_seq=16, prefill_chunk=8)
        c, stream = model.c, model.stream
        lengths = (3, 2, 1)
        t = sum(lengths)
        x = np.random.default_rng(1).standard_normal((t, c.n_embd)).astype(np.float32)
        gdn = next(L for L in model.w.layers if not L.is_attention)
        attn = next(L for L in model.w.layers if L.is_attention)

        def run(L, rows, parts):
            """The mixer of layer L over x[rows] with parts [(state, first row, n)]; its output [rows, K]."""
            model._rows_step = False
            for st, _, n in parts:
                position.set_kv_len(st.pos, st.kv_len, n, stream=stream)
            act = model._norm_act(cuda.to_device(x[rows]), L.attn_norm, len(x[rows]))
            if L.is_attention:
                return model._attention(L, len(x[rows]), parts, act).copy_to_host()
            yq, ys = model._gdn(L, len(x[rows]), parts, act)
            return np.concatenate([yq.copy_to_host().astype(np.float32),
                                   np.repeat(ys.copy_to_host(), 32, axis=1)], axis=1)
        for L in (gdn, attn):
            packed = [model.new_state(16) for _ in lengths]
            alone = [model.new_state(16) for _ in lengths]
            for st in packed + alone:
                st.reset(stream)
            starts = np.cumsum((0,) + lengths[:-1])
            got = run(L, slice(0, t), [(st, r0, n) for st, r0, n in zip(packed, starts, lengths)])
            want = np.concatenate([run(L, slice(r0, r0 + n), [(st, 0, n)])
                                   for st, r0, n in zip(alone, starts, lengths)])
            np.testing.assert_array_equal(got, want)
            for a, b, n in zip(packed, alone, lengths):
                for mine, theirs in ((a.ssm, b.ssm), (a.conv, b.conv), (a.k_cache, b.k_cache), (a.v_cache, b.v_cache)):
                    if L.index in mine:                        # KV rows past the n written are never read
                        got, want = mine[L.index].copy_to_host(), theirs[L.index].copy_to_host()
                        if mine is a.k_cache or mine is a.v_cache:
                            got, want = got[:, :n], want[:, :n]
                        np.testing.assert_array_equal(got, want)
