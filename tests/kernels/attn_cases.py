"""Shared inputs and the float64 oracle for the attention kernel tests (test_flash_attn_decode/prefill).

Inputs: an f16 KV cache [Hkv, max_seq, d] whose rows at and past the valid length hold NaN (reading one
fails the test), queries, and a projection row block carrying the gates. The reference reads the same f16
cache values and queries, so the difference is the kernel's float32 arithmetic. Tolerance:
|Δ| ≤ atol + rtol·|ref| with rtol = 8·d·2^-24 (worst-case relative error of a length-d float32 dot
product, ×8 for the exp / rescale / combine chain) and atol = rtol·max|v|.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.flash_attn.ref import attention_ref, gate_ref
from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available

U32 = 2.0 ** -24
needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def attention_inputs(rng, T, H, Hkv, d, L, max_seq, q_dtype=np.float32):
    """q [T, H, d], k_cache / v_cache [Hkv, max_seq, d] f16 (rows ≥ L are NaN), proj [T, 2dH + 2dHkv] f32."""
    q = rng.standard_normal((T, H, d)).astype(q_dtype)
    k_cache = np.full((Hkv, max_seq, d), np.nan, np.float16)
    v_cache = np.full((Hkv, max_seq, d), np.nan, np.float16)
    k_cache[:, :L] = rng.standard_normal((Hkv, L, d))
    v_cache[:, :L] = rng.standard_normal((Hkv, L, d))
    proj = rng.standard_normal((T, 2 * d * H + 2 * d * Hkv)).astype(np.float32)
    return q, k_cache, v_cache, proj


def assert_gated_attention(out, q, k_cache, v_cache, proj, q_pos, L):
    """out (any shape holding [T, H·d]) against the float64 reference of queries at positions q_pos."""
    T, H, d = q.shape
    k = k_cache[:, :L].transpose(1, 0, 2).astype(np.float32)           # [L, Hkv, d]
    v = v_cache[:, :L].transpose(1, 0, 2).astype(np.float32)
    o = attention_ref(q.astype(np.float32), k, v, np.asarray(q_pos))
    gate = proj[:, :2 * d * H].reshape(T, H, 2, d)[:, :, 1]
    ref = gate_ref(o, gate).astype(np.float64)
    rtol = 8 * d * U32
    atol = rtol * np.abs(v).max()
    err = np.abs(np.asarray(out).reshape(ref.shape) - ref)
    assert np.all(err <= atol + rtol * np.abs(ref)), f"max|Δ| {err.max():.3e} (atol {atol:.1e})"
