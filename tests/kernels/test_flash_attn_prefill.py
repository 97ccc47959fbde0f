"""attention_prefill (tiled causal GQA, f16 cache, gate fused) against the float64 NumPy reference.

The reference reads the same f16 cache values and queries, so the difference is the kernel's float32
arithmetic. Tolerance: |Δ| ≤ atol + rtol·|ref| with rtol = 8·d·2^-24 (worst-case relative error of a
length-d float32 dot product, ×8 for the exp / rescale chain) and atol = rtol·max|v|.
Cache rows at and past pos0+T hold NaN (reading one fails the test); the output starts as NaN.
"""
import numpy as np
import pytest

from attn_cases import assert_gated_attention, attention_inputs, needs_gpu, needs_sim_or_gpu
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.flash_attn.prefill import attention_prefill


def _check_prefill(T, H, Hkv, d, pos0, q_dtype=np.float32, seed=0):
    L = pos0 + T
    q, k_cache, v_cache, proj = attention_inputs(np.random.default_rng(seed), T, H, Hkv, d, L, L + 7, q_dtype)
    d_out = cuda.to_device(np.full((T, H * d), np.nan, np.float32))
    attention_prefill(cuda.to_device(q), cuda.to_device(k_cache), cuda.to_device(v_cache),
                      cuda.to_device(np.array([pos0], np.int32)), cuda.to_device(proj), d_out)
    assert_gated_attention(d_out.copy_to_host(), q, k_cache, v_cache, proj, pos0 + np.arange(T), L)


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("T,H,Hkv,d,pos0", [
    (1, 4, 1, 32, 0), (7, 4, 2, 48, 0), (40, 4, 1, 32, 0), (9, 4, 2, 48, 30), (1, 2, 1, 16, 70)],
    ids=["T1-H4-HKV1-D32", "T7-H4-HKV2-D48", "T40-H4-HKV1-D32", "T9-H4-HKV2-D48-pos30",
         "T1-H2-HKV1-D16-pos70"])
def test_prefill_tiny(T, H, Hkv, d, pos0):
    _check_prefill(T, H, Hkv, d, pos0)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_prefill_tiny_f16_query():
    _check_prefill(5, 2, 2, 32, 3, q_dtype=np.float16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [1, 7, 63, 113, 1023])
@pytest.mark.parametrize("pos0", [0, 3, 799])
@pytest.mark.parametrize("H", [16, 24], ids=["9B", "27B"])
def test_prefill_full(H, pos0, T):
    _check_prefill(T, H, 4, 256, pos0)
