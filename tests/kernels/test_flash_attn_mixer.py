"""The attention kernels chained like the model runs them: chunked prefill, then token-by-token decode.

qk_norm_rope_store writes the f16 cache and the queries; attention_prefill / attention_decode read them.
Three checks per run:
1. Tight: every output against attention_ref on the kernel's own queries and final cache contents
   (the kernels' float32 arithmetic only): |Δ| ≤ atol + rtol·|ref|, rtol = 8·d·2^-24, atol = rtol·max|v|.
   This catches positions, chunk boundaries and cache rows written by one call and read by another.
2. The final cache against the reference keys and values, as in test_rope_kernel.py.
3. Loose: the outputs against attn_mixer_ref with a float32 cache. The f16 cache perturbs each k and v
   element by ≤ 2^-11 relative, so a score moves by ≤ 2^-11·Σ|q_i k_i|/√d =: δ and the output by
   ≤ 2^-11·max|v| + 2δ·max|v| (softmax weights change by a factor within e^(±2δ)); bound stated per row.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.flash_attn.decode import alloc_decode_workspace, attention_decode
from ninfer_numba.kernels.flash_attn.prefill import attention_prefill
from ninfer_numba.kernels.flash_attn.ref import attention_ref, attn_mixer_ref, gate_ref, qk_norm_rope_ref
from ninfer_numba.kernels.flash_attn.rope import qk_norm_rope_store

U32, U16 = 2.0 ** -24, 2.0 ** -11
needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _run_chain(H, Hkv, d, n_rot, chunks, n_decode, n_splits, seed=0):
    rng = np.random.default_rng(seed)
    base, eps = 1e7, 1e-6
    n_pre = sum(chunks)
    N = n_pre + n_decode
    max_seq = N + 3
    proj = rng.standard_normal((N, 2 * d * H + 2 * d * Hkv)).astype(np.float32)
    qw = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    kw = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    d_qw, d_kw = cuda.to_device(qw), cuda.to_device(kw)
    d_k = cuda.to_device(np.full((Hkv, max_seq, d), np.nan, np.float16))
    d_v = cuda.to_device(np.full((Hkv, max_seq, d), np.nan, np.float16))
    pos_buf = cuda.to_device(np.zeros(1, np.int32))
    len_buf = cuda.to_device(np.zeros(1, np.int32))
    ws = alloc_decode_workspace(H, d, n_splits)
    outs, qs = [], []
    rope = dict(H=H, Hkv=Hkv, n_rot=n_rot, base=base, eps=eps)
    pos = 0
    for T in list(chunks) + [1] * n_decode:
        d_proj = cuda.to_device(proj[pos:pos + T])
        d_q = cuda.to_device(np.full((T, H, d), np.nan, np.float32))
        d_out = cuda.to_device(np.full((T, H * d), np.nan, np.float32))
        pos_buf.copy_to_device(np.array([pos], np.int32))
        qk_norm_rope_store(d_proj, d_qw, d_kw, pos_buf, d_q, d_k, d_v, **rope)
        if pos < n_pre:
            attention_prefill(d_q, d_k, d_v, pos_buf, d_proj, d_out)
        else:
            len_buf.copy_to_device(np.array([pos + 1], np.int32))
            attention_decode(d_q, d_k, d_v, len_buf, d_proj, d_out.reshape(H * d), ws)
        outs.append(d_out.copy_to_host())
        qs.append(d_q.copy_to_host())
        pos += T
    out, q = np.concatenate(outs), np.concatenate(qs)
    k_cache, v_cache = d_k.copy_to_host(), d_v.copy_to_host()
    assert np.isnan(k_cache[:, N:]).all()

    # 1. tight, on the kernel's own queries and cache
    k = k_cache[:, :N].transpose(1, 0, 2).astype(np.float32)
    v = v_cache[:, :N].transpose(1, 0, 2).astype(np.float32)
    _, gate, k_ref, v_ref = qk_norm_rope_ref(proj, qw, kw, 0, H, Hkv, d, n_rot, base, eps)
    ref = gate_ref(attention_ref(q, k, v, np.arange(N)), gate).astype(np.float64)
    rtol = 8 * d * U32
    err = np.abs(out - ref)
    assert np.all(err <= rtol * np.abs(v).max() + rtol * np.abs(ref)), f"tight max|Δ| {err.max():.3e}"
    # 2. the cache the kernels wrote
    k_bound = U16 * np.abs(k_ref) + (d + 16) * U32 * np.abs(k_ref).max()
    assert np.all(np.abs(k - k_ref) <= k_bound)
    np.testing.assert_array_equal(v, v_ref.astype(np.float16).astype(np.float32))
    # 3. loose, against the float32-cache mixer reference
    kc32, vc32 = np.zeros((max_seq, Hkv, d), np.float32), np.zeros((max_seq, Hkv, d), np.float32)
    mixer = attn_mixer_ref(proj, qw, kw, kc32, vc32, 0, H, Hkv, d, n_rot, base, eps).astype(np.float64)
    k_max = np.repeat(np.abs(k_ref).max(axis=0), H // Hkv, axis=0)      # [H, d] max over positions
    qk_abs = np.einsum("thd,hd->th", np.abs(q), k_max)                   # ≥ Σ_i |q_i k_i| for every key
    delta = U16 * qk_abs / np.sqrt(d)                                   # [T, H] score perturbation bound
    v_max = np.abs(v_ref).max()
    bound = (U16 * v_max + 2 * delta * v_max)[:, :, None] * np.ones(d)  # [T, H, d]
    err3 = np.abs(out - mixer).reshape(N, H, d)
    assert np.all(err3 <= bound + rtol * v_max), f"loose max|Δ| {err3.max():.3e}"


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("H,Hkv,d,n_rot,chunks,n_decode,n_splits", [
    (4, 2, 32, 8, (9, 4), 3, 2), (4, 1, 48, 16, (5,), 2, 3)],
    ids=["H4-HKV2-D32-chunks9+4-dec3", "H4-HKV1-D48-chunk5-dec2"])
def test_chain_tiny(H, Hkv, d, n_rot, chunks, n_decode, n_splits):
    _run_chain(H, Hkv, d, n_rot, chunks, n_decode, n_splits)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("H", [16, 24], ids=["9B", "27B"])
def test_chain_full(H):
    _run_chain(H, 4, 256, 64, (113, 686), 4, 128)
