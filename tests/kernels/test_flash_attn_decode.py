"""attention_decode (split-K over the f16 cache, gate fused) against the float64 NumPy reference.

The reference reads the same f16 cache values (converted exactly to float64) and the same query, so the
only difference is the kernel's float32 arithmetic: length-d dot products, exp, and sums over ≤ kv_len
terms. Tolerance: |Δ| ≤ atol + rtol·|ref| with rtol = 8·d·2^-24 (worst-case relative error of a length-d
float32 dot product, ×8 for the exp / rescale / combine chain) and atol = rtol·max|v|.
Cache rows at and past kv_len hold NaN, so reading any of them fails the test; the output starts as NaN.
"""
import numpy as np
import pytest

from attn_cases import assert_gated_attention, attention_inputs, needs_gpu, needs_sim_or_gpu
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.flash_attn.decode import alloc_decode_workspace, attention_decode


def _check_decode(H, Hkv, d, kv_len, n_splits, q_dtype=np.float32, seed=0, max_seq=None):
    q, k_cache, v_cache, proj = attention_inputs(np.random.default_rng(seed), 1, H, Hkv, d, kv_len,
                                                 max_seq or kv_len + 5, q_dtype)
    d_out = cuda.to_device(np.full(H * d, np.nan, np.float32))
    ws = alloc_decode_workspace(H, d, n_splits)
    attention_decode(cuda.to_device(q), cuda.to_device(k_cache), cuda.to_device(v_cache),
                     cuda.to_device(np.array([kv_len], np.int32)), cuda.to_device(proj), d_out, ws)
    assert_gated_attention(d_out.copy_to_host(), q, k_cache, v_cache, proj, [kv_len - 1], kv_len)


def _check_batched(H, Hkv, d, lens, slots, n_slots, n_splits, max_seq):
    """B = len(slots) queries at once, row b over cache slot slots[b] of an [n_slots·Hkv, max_seq, d] slab
    with its own length lens[b]; every row against the one-sequence reference of its slot."""
    rng = np.random.default_rng(7)
    cases = [attention_inputs(rng, 1, H, Hkv, d, lens[b], max_seq) for b in range(len(slots))]
    k_slab = np.full((n_slots * Hkv, max_seq, d), np.nan, np.float16)   # unnamed slots: NaN, never read
    v_slab = np.full_like(k_slab, np.nan)
    for (_, kc, vc, _), s_ in zip(cases, slots):
        k_slab[s_ * Hkv:(s_ + 1) * Hkv], v_slab[s_ * Hkv:(s_ + 1) * Hkv] = kc, vc
    ws = alloc_decode_workspace(H, d, n_splits, batch=len(slots))
    ws.slots.copy_to_device(np.array(slots, np.int32))
    d_out = cuda.to_device(np.full((len(slots), H * d), np.nan, np.float32))
    attention_decode(cuda.to_device(np.concatenate([c[0] for c in cases])), cuda.to_device(k_slab),
                     cuda.to_device(v_slab), cuda.to_device(np.array(lens, np.int32)),
                     cuda.to_device(np.concatenate([c[3] for c in cases])), d_out, ws, kv_heads=Hkv)
    out = d_out.copy_to_host()
    for b, (q, kc, vc, proj) in enumerate(cases):
        assert_gated_attention(out[b], q, kc, vc, proj, [lens[b] - 1], lens[b])


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_decode_batched_slots():
    _check_batched(4, 2, 32, lens=[5, 77, 1], slots=[2, 0, 3], n_slots=4, n_splits=3, max_seq=80)


@pytest.mark.gpu
@needs_gpu
def test_decode_batched_model_shape():
    _check_batched(16, 4, 256, lens=[8192, 1, 799, 4096, 33, 2048, 100, 5000], slots=[3, 7, 0, 5, 1, 6, 2, 4],
                   n_slots=8, n_splits=99, max_seq=8200)


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("H,Hkv,d,kv_len,n_splits", [
    (4, 1, 32, 1, 4), (4, 2, 48, 3, 4), (4, 1, 48, 40, 3), (4, 2, 32, 77, 4), (2, 2, 48, 77, 2),
    (6, 1, 32, 33, 8), (4, 1, 32, 77, 1)],
    ids=["L1-H4-HKV1-D32", "L3-H4-HKV2-D48", "L40-H4-HKV1-D48", "L77-H4-HKV2-D32-3splits",
         "L77-H2-HKV2-D48-2splits", "L33-H6-HKV1-D32", "L77-H4-HKV1-D32-1split-3tiles"])
def test_decode_tiny(H, Hkv, d, kv_len, n_splits):
    _check_decode(H, Hkv, d, kv_len, n_splits)


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("H,Hkv,d,kv_len,n_splits", [
    (3, 1, 40, 113, 2), (6, 1, 32, 63, 1), (4, 2, 32, 17, 8), (4, 2, 256, 7, 2)],
    ids=["L113-H3-HKV1-D40-ragged-steps", "L63-H6-HKV1-D32-2rows-per-step", "L17-H4-HKV2-D32-empty-splits",
         "L7-H4-HKV2-D256-all-lanes"])
def test_decode_tiny_awkward(H, Hkv, d, kv_len, n_splits):
    """G = 3 and d = 40 (idle lanes), G = 6 (2-row steps) over many steps of one warp, splits left empty
    by the rounding of the range to whole block steps, and d = 256 (every lane holds 8 dims)."""
    _check_decode(H, Hkv, d, kv_len, n_splits, seed=1)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_decode_tiny_f16_query():
    _check_decode(4, 2, 48, 9, 2, q_dtype=np.float16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv_len", [1, 3, 799, 8192, 32768])
@pytest.mark.parametrize("H", [16, 24], ids=["9B", "27B"])
def test_decode_full(H, kv_len):
    _check_decode(H, 4, 256, kv_len, 128)


@pytest.mark.gpu
@needs_gpu
def test_decode_few_splits_long_cache():
    """Few splits over a long cache: many tiles per block exercise the running rescale."""
    _check_decode(16, 4, 256, 5000, 3)
