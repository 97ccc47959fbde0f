"""NumPy reference of the gated attention layer (reference/qwen35-format.md §5 "Attention layer").

Pure NumPy, no numba: the CPU reference model imports it. Written from the math, not from the kernels.

Precision choices (the kernels are tested against these):
- ``rmsnorm_ref`` squares in float32 and sums in float64, then scales in float32, as ggml's CPU rms_norm
  does (float products, ``ggml_float`` = double accumulator, float mean and scale).
- ``rope_neox_ref`` computes θ, cos and sin in float64 and rotates in float64, returning float32. ggml
  computes θ in float32; at positions ~2^15 that float32 θ is off by ~1e-3 rad, so the float64 form is
  the exact rotation and the kernels match it, not ggml's rounding.
- ``attention_ref`` runs in float64 throughout and returns float32.

Column layout of the fused projection row ``proj`` [2·d·H + 2·d·Hkv] (what the q|k|v GEMM produces):
    [q_0 | g_0 | q_1 | g_1 | ... | q_{H-1} | g_{H-1} | k_0 ... k_{Hkv-1} | v_0 ... v_{Hkv-1}]
each block d wide: per query head h, query at [2dh, 2dh+d) and output gate at [2dh+d, 2d(h+1)).
"""
from __future__ import annotations

import numpy as np


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., D], w [D] -> x / sqrt(mean(x², -1) + eps) · w, float32."""
    x32 = np.asarray(x, np.float32)
    sq = (x32 * x32).astype(np.float64)                    # float32 products, float64 sum
    mean = np.float32(sq.sum(axis=-1, keepdims=True) / x32.shape[-1])
    scale = (np.float32(1.0) / np.sqrt(mean + np.float32(eps))).astype(np.float32)
    return (x32 * scale * np.asarray(w, np.float32)).astype(np.float32)


def rope_inv_freq_ref(n_rot: int, base: float) -> np.ndarray:
    """[n_rot/2] float64: base^(−2i/n_rot) for rotary pair i."""
    if n_rot % 2:
        raise ValueError(f"n_rot must be even, got {n_rot}")
    i = np.arange(n_rot // 2, dtype=np.float64)
    return np.float64(base) ** (-2.0 * i / n_rot)


def rope_neox_ref(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """x [T, nh, d], pos [T] int -> rotated copy [T, nh, d] float32 (NEOX pairs (i, i+n_rot/2), i < n_rot/2).

    θ = pos·base^(−2i/n_rot); (x[i], x[i+half]) → (x[i]cosθ − x[i+half]sinθ, x[i]sinθ + x[i+half]cosθ);
    dims ≥ n_rot pass through unchanged.
    """
    x = np.asarray(x)
    half = n_rot // 2
    if n_rot > x.shape[-1]:
        raise ValueError(f"n_rot {n_rot} exceeds head dim {x.shape[-1]}")
    theta = np.asarray(pos, np.float64)[:, None] * rope_inv_freq_ref(n_rot, base)[None, :]   # [T, half]
    cos = np.cos(theta)[:, None, :]                        # [T, 1, half]
    sin = np.sin(theta)[:, None, :]
    out = np.array(x, np.float64)
    lo = out[..., :half].copy()                            # [T, nh, half]
    hi = out[..., half:n_rot].copy()
    out[..., :half] = lo * cos - hi * sin
    out[..., half:n_rot] = lo * sin + hi * cos
    return out.astype(np.float32)


def split_q_gate_ref(proj_q: np.ndarray, H: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """proj_q [T, 2·d·H] -> (q [T, H, d], gate [T, H, d]); per head the query comes first, then the gate."""
    qg = np.asarray(proj_q).reshape(-1, H, 2, d)
    return qg[:, :, 0, :].copy(), qg[:, :, 1, :].copy()


def split_proj_ref(proj: np.ndarray, H: int, Hkv: int, d: int):
    """proj [T, 2dH + 2d·Hkv] -> (q [T,H,d], gate [T,H,d], k [T,Hkv,d], v [T,Hkv,d])."""
    proj = np.asarray(proj)
    n_qg = 2 * d * H
    if proj.shape[-1] != n_qg + 2 * d * Hkv:
        raise ValueError(f"proj has {proj.shape[-1]} columns, expected {n_qg + 2 * d * Hkv}")
    q, gate = split_q_gate_ref(proj[:, :n_qg], H, d)
    k = proj[:, n_qg:n_qg + d * Hkv].reshape(-1, Hkv, d)
    v = proj[:, n_qg + d * Hkv:].reshape(-1, Hkv, d)
    return q, gate, k.copy(), v.copy()


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
    """Causal GQA softmax attention, float64 inside.

    q [T, H, d], k [L, Hkv, d], v [L, Hkv, d] (cache positions 0..L-1), q_pos [T] int -> o [T, H, d] float32.
    Query t attends to keys j ≤ q_pos[t] with scale 1/√d; query head h uses KV head h // (H/Hkv).
    """
    T, H, d = q.shape
    L, Hkv, _ = k.shape
    if H % Hkv:
        raise ValueError(f"H={H} is not a multiple of Hkv={Hkv}")
    group = H // Hkv
    q64 = np.asarray(q, np.float64)
    k64 = np.repeat(np.asarray(k, np.float64), group, axis=1)     # [L, H, d]: head h -> kv head h // group
    v64 = np.repeat(np.asarray(v, np.float64), group, axis=1)
    scores = np.einsum("thd,lhd->htl", q64, k64) / np.sqrt(d)      # [H, T, L]
    allowed = np.arange(L)[None, :] <= np.asarray(q_pos)[:, None]  # [T, L]
    if not allowed.any(axis=1).all():
        raise ValueError("a query has no visible key (q_pos beyond the cache?)")
    scores = np.where(allowed[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("htl,lhd->thd", p, v64).astype(np.float32)


def gate_ref(o: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """o [T, H, d], gate [T, H, d] -> o ⊙ σ(gate) flattened to [T, H·d] float32 (σ in float64)."""
    g = 1.0 / (1.0 + np.exp(-np.asarray(gate, np.float64)))
    return (np.asarray(o, np.float64) * g).astype(np.float32).reshape(o.shape[0], -1)


def qk_norm_rope_ref(proj, q_norm_w, k_norm_w, pos0: int, H: int, Hkv: int, d: int,
                     n_rot: int, base: float, eps: float):
    """proj [T, P] -> (q [T,H,d], gate [T,H,d], k [T,Hkv,d], v [T,Hkv,d]) after QK-norm and RoPE at pos0+t."""
    q, gate, k, v = split_proj_ref(proj, H, Hkv, d)
    pos = pos0 + np.arange(q.shape[0])
    q = rope_neox_ref(rmsnorm_ref(q, q_norm_w, eps), pos, n_rot, base)
    k = rope_neox_ref(rmsnorm_ref(k, k_norm_w, eps), pos, n_rot, base)
    return q, gate, k, np.asarray(v, np.float32)


def attn_mixer_ref(proj, q_norm_w, k_norm_w, k_cache, v_cache, pos0: int, H: int, Hkv: int, d: int,
                   n_rot: int, base: float, eps: float, store_dtype=np.float32, store=None) -> np.ndarray:
    """Gated attention mixer for T new tokens at positions pos0..pos0+T-1.

    proj [T, 2dH + 2d·Hkv] float32 (column layout in the module docstring), q_norm_w [d], k_norm_w [d],
    k_cache / v_cache [max_seq, Hkv, d] float32, written in place at rows pos0..pos0+T-1.
    store_dtype: q, k and v are rounded through it (np.float16: as the kernels store the rotated queries
    and the f16 KV cache); the arithmetic stays float32. store: (k, v) -> (k', v'), what a coded cache keeps
    (kvq/ref.py's kv_round_trip), applied after the rounding.
    Returns o_gated [T, H·d] float32: attention over cache rows [0, pos0+T) causally, times σ(gate).
    """
    proj = np.asarray(proj, np.float32)
    T = proj.shape[0]
    if pos0 < 0 or pos0 + T > k_cache.shape[0]:
        raise ValueError(f"positions [{pos0}, {pos0 + T}) do not fit a cache of {k_cache.shape[0]}")
    q, gate, k, v = qk_norm_rope_ref(proj, q_norm_w, k_norm_w, pos0, H, Hkv, d, n_rot, base, eps)
    if store_dtype != np.float32:
        q, k, v = (a.astype(store_dtype).astype(np.float32) for a in (q, k, v))
    if store is not None:
        k, v = store(k, v)
    k_cache[pos0:pos0 + T] = k
    v_cache[pos0:pos0 + T] = v
    L = pos0 + T
    o = attention_ref(q, k_cache[:L], v_cache[:L], pos0 + np.arange(T))
    return gate_ref(o, gate)
