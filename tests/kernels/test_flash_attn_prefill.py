"""attention_prefill (tiled causal GQA, f16 cache, gate fused) against the float64 NumPy reference.

The reference reads the same f16 cache values and queries, so the difference is the kernel's float32
arithmetic. Tolerance: |Δ| ≤ atol + rtol·|ref| with rtol = 8·d·2^-24 (worst-case relative error of a
length-d float32 dot product, ×8 for the exp / rescale chain) and atol = rtol·max|v|.
Cache rows at and past pos0+T hold NaN (reading one fails the test); the output starts as NaN.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.flash_attn.prefill import attention_prefill
from ninfer_numba.kernels.flash_attn.ref import attention_ref, gate_ref

U32 = 2.0 ** -24
needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _check_prefill(T, H, Hkv, d, pos0, q_dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    L = pos0 + T
    max_seq = L + 7
    q = rng.standard_normal((T, H, d)).astype(q_dtype)
    k_cache = np.full((Hkv, max_seq, d), np.nan, np.float16)
    v_cache = np.full((Hkv, max_seq, d), np.nan, np.float16)
    k_cache[:, :L] = rng.standard_normal((Hkv, L, d))
    v_cache[:, :L] = rng.standard_normal((Hkv, L, d))
    proj = rng.standard_normal((T, 2 * d * H + 2 * d * Hkv)).astype(np.float32)
    d_out = cuda.to_device(np.full((T, H * d), np.nan, np.float32))
    attention_prefill(cuda.to_device(q), cuda.to_device(k_cache), cuda.to_device(v_cache),
                      cuda.to_device(np.array([pos0], np.int32)), cuda.to_device(proj), d_out)
    out = d_out.copy_to_host()

    k = k_cache[:, :L].transpose(1, 0, 2).astype(np.float32)           # [L, Hkv, d]
    v = v_cache[:, :L].transpose(1, 0, 2).astype(np.float32)
    o = attention_ref(q.astype(np.float32), k, v, pos0 + np.arange(T))
    gate = proj[:, :2 * d * H].reshape(T, H, 2, d)[:, :, 1]
    ref = gate_ref(o, gate).astype(np.float64)
    rtol = 8 * d * U32
    atol = rtol * np.abs(v).max()
    err = np.abs(out - ref)
    assert np.all(err <= atol + rtol * np.abs(ref)), f"max|Δ| {err.max():.3e} (atol {atol:.1e})"


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
