"""NumPy references for the Q8 activation quantizers and the Q8 x Q8 matrix product.

Pure NumPy (no numba import), so the CPU reference model can use it. Written from the math:

- Weights (repacked GGUF Q8_0): ``wq: int8 [N, K]`` row-major, ``ws: float16 [N, K/32]`` block scales.
- Activations, quantized per 32-block of a row: ``xq: int8 [M, K]``, ``xs: float32 [M, K/32]``.
- Product: ``out[m, n] = sum_b float(ws[n, b]) * xs[m, b] * S[m, n, b]`` with the block dot product
  ``S[m, n, b] = sum_{i in block b} wq[n, i] * xq[m, i]`` exact in int32 (|S| <= 32 * 128 * 128 = 2^19).

W8A16 product (the Hopper prefill GEMM, gemm_w8a16.py): activations ``xh: float16 [M, K]``, weights
dequantized once per element to ``float16(wq · ws)``, products summed in float32:
``out[m, n] = sum_k xh[m, k] · float16(wq[n, k] · ws[n, k/32])``. The kernel takes the activations in
*fragment order* (``to_fragment_order``): the columns of each 32-block permuted so that the weight bytes a
tensor-core thread needs are contiguous in the (unpermuted) weight rows.

Quantization rule (shared bit-for-bit with the GPU kernels): per 32-block, ``d = amax / 127`` in float32
(one correctly rounded division), ``q = trunc(v + copysign(0.5, v))`` with ``v = x / d`` (again one
correctly rounded float32 division, then one float32 addition: round half away from zero, up to the
rounding of that addition), and q = 0, d = 0 when amax == 0. Division instead of multiplication by
127/amax keeps the GPU from contracting the scale and the +0.5 into one fused multiply-add, which is
what makes the two sides agree bit-exactly.
"""
from __future__ import annotations

import numpy as np

QK = 32  # elements per quantization block (the GGUF Q8_0 block)


def quantize_q8_blocks_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: [M, K] float32 (K % 32 == 0) -> (xq: [M, K] int8, xs: [M, K/32] float32)."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    if k % QK:
        raise ValueError(f"K={k} is not a multiple of {QK}")
    blocks = x.reshape(m, k // QK, QK)
    amax = np.max(np.abs(blocks), axis=2)                                    # [M, K/32] float32
    d = (amax / np.float32(127.0)).astype(np.float32)                        # [M, K/32] float32
    safe_d = np.where(d == 0, np.float32(1.0), d).astype(np.float32)
    v = (blocks / safe_d[:, :, None]).astype(np.float32)                     # [M, K/32, 32] float32
    q = np.trunc(v + np.copysign(np.float32(0.5), v).astype(np.float32))
    q = np.where(d[:, :, None] == 0, np.float32(0.0), q)
    return q.astype(np.int8).reshape(m, k), d


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: [M, K] float32, w: [K] float32 -> [M, K] float32; x / sqrt(mean(x^2) + eps) * w, in float32."""
    x = np.asarray(x, dtype=np.float32)
    ms = np.mean(x * x, axis=1, dtype=np.float32, keepdims=True)             # [M, 1] float32
    r = (np.float32(1.0) / np.sqrt(ms + np.float32(eps))).astype(np.float32)
    return ((x * r) * np.asarray(w, dtype=np.float32)).astype(np.float32)


def silu_mul_ref(gu: np.ndarray) -> np.ndarray:
    """gu: [M, 2F] float32 (gate | up) -> [M, F] float32 silu(gate) * up, in float32."""
    gu = np.asarray(gu, dtype=np.float32)
    f = gu.shape[1] // 2
    gate, up = gu[:, :f], gu[:, f:]
    with np.errstate(over="ignore"):                     # exp(-gate) = inf gives silu = -0, as on the GPU
        silu = gate / (np.float32(1.0) + np.exp(-gate))
    return (silu * up).astype(np.float32)


def rmsnorm_f16_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm_ref rounded once to float16 (nearest even) -> [M, K] float16, as act_f16.rmsnorm_f16."""
    with np.errstate(over="ignore"):
        return rmsnorm_ref(x, w, eps).astype(np.float16)


def silu_mul_f16_ref(gu: np.ndarray) -> np.ndarray:
    """silu_mul_ref rounded once to float16 (nearest even) -> [M, F] float16, as act_f16.silu_mul_f16."""
    with np.errstate(over="ignore"):
        return silu_mul_ref(gu).astype(np.float16)


def rmsnorm_quant_ref(x, w, eps):
    """RMSNorm then per-block quantization: -> (xq [M, K] int8, xs [M, K/32] float32)."""
    return quantize_q8_blocks_ref(rmsnorm_ref(x, w, eps))


def silu_mul_quant_ref(gu):
    """silu(gate) * up then per-block quantization: -> (xq [M, F] int8, xs [M, F/32] float32)."""
    return quantize_q8_blocks_ref(silu_mul_ref(gu))


def _dequant64(q, scales, rows):
    """q[rows] * scale of its 32-block, as float64 [len(rows), K]; exact (8-bit times 11- or 24-bit)."""
    q = q[rows].astype(np.float64)
    return (q.reshape(q.shape[0], -1, QK) * scales[rows].astype(np.float64)[:, :, None]).reshape(q.shape)


def q8_matmul_ref(wq, ws, xq, xs, *, with_abs: bool = False, row_chunk: int = 4096):
    """Q8 x Q8 product in float64.

    wq: [N, K] int8, ws: [N, K/32] float16, xq: [M, K] int8, xs: [M, K/32] float32
    -> out: [M, N] float64, and with ``with_abs`` a second [M, N] float64 ``mag`` >= sum_b |term_b|, the
    scale of the float32 rounding error a kernel may make when it adds the K/32 block terms in any order.

    sum_b ws[n,b] xs[m,b] S[m,n,b] is computed as one float64 product of the dequantized operands
    (xs * xq) @ (ws * wq)^T: every element product is exact in float64 (< 2^51), and the float64
    summation error (~K 2^-53 relative) is far below the float32 bounds this reference is used with.
    mag is |xs * xq| @ |ws * wq|^T, which bounds sum_b |ws xs S| because |S| <= sum_i |wq xq|.
    """
    wq, xq = np.asarray(wq), np.asarray(xq)
    n, k = wq.shape
    m = xq.shape[0]
    if xq.shape[1] != k or k % QK:
        raise ValueError(f"shape mismatch: wq {wq.shape}, xq {xq.shape}")
    x64 = _dequant64(xq, np.asarray(xs), slice(None))                          # [M, K] float64
    out = np.empty((m, n), np.float64)
    mag = np.empty((m, n), np.float64) if with_abs else None
    for n0 in range(0, n, row_chunk):
        w64 = _dequant64(wq, np.asarray(ws), slice(n0, min(n, n0 + row_chunk)))  # [chunk, K] float64
        out[:, n0:n0 + w64.shape[0]] = x64 @ w64.T
        if with_abs:
            mag[:, n0:n0 + w64.shape[0]] = np.abs(x64) @ np.abs(w64).T
    return (out, mag) if with_abs else out


def dequant_f16_ref(wq, ws) -> np.ndarray:
    """wq [N, K] int8, ws [N, K/32] float16 -> [N, K] float16: each weight q · d rounded once to float16
    (q · d is exact in float32: 8 by 11 significant bits), as the W8A16 kernel's dequantization."""
    wq = np.asarray(wq)
    n, k = wq.shape
    prod = wq.astype(np.float32).reshape(n, k // QK, QK) * np.asarray(ws).astype(np.float32)[:, :, None]
    with np.errstate(over="ignore"):
        return prod.reshape(n, k).astype(np.float16)


def w8a16_matmul_ref(wq, ws, xh, *, with_abs: bool = False, row_chunk: int = 4096):
    """W8A16 product in float64: xh [M, K] float16 against float16(wq · ws) -> out [M, N] float64, and with
    ``with_abs`` mag = |xh| @ |w16|ᵀ (every product is exact in float64, so out carries no error worth
    counting against float32 kernels)."""
    x64 = np.asarray(xh).astype(np.float64)
    n = np.asarray(wq).shape[0]
    out = np.empty((x64.shape[0], n), np.float64)
    mag = np.empty_like(out) if with_abs else None
    for n0 in range(0, n, row_chunk):
        w64 = dequant_f16_ref(wq[n0:n0 + row_chunk], ws[n0:n0 + row_chunk]).astype(np.float64)
        out[:, n0:n0 + w64.shape[0]] = x64 @ w64.T
        if with_abs:
            mag[:, n0:n0 + w64.shape[0]] = np.abs(x64) @ np.abs(w64).T
    return (out, mag) if with_abs else out


def w8a16_error_bound(mag: np.ndarray, k: int, prior: np.ndarray | float = 0.0) -> np.ndarray:
    """Bound on |kernel result - exact| for the W8A16 product with float32 accumulation on tensor cores.

    The tensor cores add each step's 16 exact f16 x f16 products to the float32 accumulator with one
    alignment and a truncating rounding (at most 2u of the magnitudes involved, u = 2^-24); K/16 steps, an
    optional prior value and the final store add at most (K/16 + 4) · 2u of the absolute sum."""
    u = 2.0 ** -24
    return (k // 16 + 4) * 2 * u * (mag + np.abs(prior)) + 1e-30


def fragment_order() -> np.ndarray:
    """[32] int: position l of a 32-block in fragment order holds column FRAGMENT_ORDER[l] of the block.

    l = 16 s + 8 h + 2 t + e (k16 step s, fragment half h, quad lane t, element e) holds column
    p = 8 t + 4 s + 2 h + e: the 8 weight bytes [8t, 8t + 8) of a block are exactly what lane t of a quad
    needs for both k16 steps (a0/a1 then a2/a3 pairs of each step), and the permutation stays inside the
    block, so a K % 64 == 32 tail is still a plain half stage."""
    l = np.arange(QK)
    return 8 * ((l >> 1) & 3) + 4 * (l >> 4) + 2 * ((l >> 3) & 1) + (l & 1)


def to_fragment_order(x: np.ndarray) -> np.ndarray:
    """[M, K] (K % 32 == 0) in natural column order -> the same values in fragment order."""
    m, k = x.shape
    return np.ascontiguousarray(x.reshape(m, k // QK, QK)[:, :, fragment_order()].reshape(m, k))


def from_fragment_order(x: np.ndarray) -> np.ndarray:
    """Inverse of to_fragment_order."""
    m, k = x.shape
    out = np.empty_like(x).reshape(m, k // QK, QK)
    out[:, :, fragment_order()] = x.reshape(m, k // QK, QK)
    return out.reshape(m, k)


def random_q8_operands(rng: np.random.Generator, m: int, n: int, k: int):
    """Random operands in the kernel layouts, for tests and benchmarks: wq [N, K] int8 (full range),
    ws [N, K/32] float16 (both signs, ~1e-2), xq [M, K] int8 in [-127, 127], xs [M, K/32] float32 > 0."""
    wq = rng.integers(-128, 128, (n, k), dtype=np.int8)
    ws = (rng.uniform(0.5, 2.0, (n, k // QK)) * rng.choice([-1, 1], (n, k // QK)) * 1e-2).astype(np.float16)
    xq = rng.integers(-127, 128, (m, k), dtype=np.int8)
    xs = rng.uniform(1e-3, 1e-1, (m, k // QK)).astype(np.float32)
    return wq, ws, xq, xs


def q8_error_bound(mag: np.ndarray, n_blocks: int, prior: np.ndarray | float = 0.0) -> np.ndarray:
    """Bound on |kernel fp32 result - exact| for n_blocks terms whose absolute sum is at most ``mag``.

    Each term float(ws)*xs*S costs two float32 roundings (<= 2u relative, u = 2^-24) and any summation
    order of n_blocks terms (plus an optional prior value when accumulating into out) adds at most
    (n_blocks + 1) u of the absolute sum; the float32 store of a float64 reference adds u |out|.
    """
    u = 2.0 ** -24
    return (n_blocks + 4) * u * (mag + np.abs(prior)) + 1e-30
