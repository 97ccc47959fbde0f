"""Activation quantizers that feed every Q8 GEMV/GEMM: plain, fused with RMSNorm, fused with SiLU-gating.

Output layout (see q8/ref.py): ``xq: int8 [M, K]`` and ``xs: float32 [M, K/32]`` per 32-block.
Grid (M, ceil(K / 32 / TPB)): each thread owns whole 32-blocks (block b = the thread's index within the
row, then + TPB * gridDim.y ...), so a block's absmax needs no cross-thread communication, and a decode
row (M = 1) is spread over several thread blocks instead of looping in one. A thread loads its block's
128 bytes with eight 16-byte non-coherent loads into 32 registers, takes the absmax, then quantizes from
the registers. Inputs must be C-contiguous with 16-byte aligned rows (K % 32 == 0 and an aligned base).
RMSNorm needs the whole row's sum of squares, so each of a row's thread blocks computes it (the row is
at most 70 KB and sits in L2) before quantizing its own slice.

Bit-exactness with q8/ref.py: the scale is ``d = amax / 127`` and the quantized value
``trunc(v + copysign(0.5, v))`` with ``v = value / d``: a correctly rounded float32 division (numba's
default ``div.rn.f32``; no fastmath) followed by one float32 addition. No multiply feeds an add, so the
compiler has nothing to contract into an FMA, and every constant is a float32 global so no step is
promoted to float64. Given the same float32 input values, GPU and NumPy produce identical bytes and
scales. The fused kernels compute their input values with a different summation order (RMSNorm) or a
different expf (SiLU) than NumPy, so there only values within rounding of a .5 boundary may differ
(tests/kernels/test_quant_act.py states the rule).
"""
import math

import numpy as np

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.q8.ref import (QK, quantize_q8_blocks_ref, rmsnorm_quant_ref,  # noqa: F401
                                            silu_mul_quant_ref)
from ninfer_numba.kernels.reduce import block_sum_pow2

TPB = 128                       # threads per thread block; each owns one 32-block at a time
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_NEG_HALF = np.float32(-0.5)
_F127 = np.float32(127.0)


# ---------------------------------------------------------------- device helpers ----------------------

@cuda.jit(device=True, inline=True)
def _scale_of(amax):
    """float32 block scale d = amax / 127 (correctly rounded division)."""
    return amax / _F127


@cuda.jit(device=True, inline=True)
def _quant_one(value, d):
    """Round value / d half away from zero; d > 0. Returns int32 in [-127, 127]."""
    v = value / d
    h = _HALF if v >= _F0 else _NEG_HALF
    return np.int32(v + h)     # float -> int conversion truncates toward zero


@cuda.jit(device=True, inline=True)
def _load_block(src, flat, vals):
    """vals[0:32] = the 32 float32 at flat element index ``flat`` of src (16-byte aligned)."""
    for c in range(QK // 4):
        w = ptx.ldg_nc_v4_u32(src, flat + 4 * c)
        for e in range(4):
            vals[4 * c + e] = ptx.i32_as_f32(w[e])


@cuda.jit(device=True, inline=True)
def _quantize_block_store(vals, xq, xs, m, b):
    """Quantize the 32 values of block b of row m into xq[m, 32 b : 32 b + 32] and xs[m, b]."""
    amax = _F0
    for i in range(QK):
        amax = max(amax, abs(vals[i]))
    d = _scale_of(amax)
    xs[m, b] = d
    base = b * QK
    for i in range(QK):
        xq[m, base + i] = _quant_one(vals[i], d) if amax > _F0 else 0


@cuda.jit(device=True, inline=True)
def _block_sum_f32(s_red, value):
    """Sum of ``value`` over the TPB threads of the block (tree in shared memory); all threads get it."""
    s_red[cuda.threadIdx.x] = value
    cuda.syncthreads()
    return block_sum_pow2(s_red, cuda.threadIdx.x, TPB)     # ends on a barrier: s_red is free again


@cuda.jit(device=True, inline=True)
def _row_rms_inverse(s_red, x, m, eps):
    """1 / sqrt(mean(x[m]^2) + eps) for row m of x [M, K] float32, over the block's TPB threads (consecutive
    threads on consecutive addresses, then the shared-memory tree): every kernel that normalizes a row
    computes it the same way, so their float32 results agree bit for bit."""
    k = x.shape[1]
    ss = _F0
    for i in range(cuda.threadIdx.x, k, TPB):
        v = x[m, i]
        ss += v * v
    ss = _block_sum_f32(s_red, ss)
    return _F1 / math.sqrt(ss / np.float32(k) + eps)


@cuda.jit(device=True, inline=True)
def _silu_mul(g, u):
    return g / (_F1 + math.exp(-g)) * u


# ---------------------------------------------------------------- kernels -----------------------------

@cached_jit()
def _quantize_rows_kernel(x, xq, xs):
    """x: [M, K] float32 -> xq: [M, K] int8, xs: [M, K/32] float32; grid (M, ceil(K/32/TPB)), block (TPB,)."""
    vals = cuda.local.array(QK, dtype=np.float32)        # [32] this thread's block (registers)
    m = cuda.blockIdx.x
    k = x.shape[1]
    for b in range(cuda.blockIdx.y * TPB + cuda.threadIdx.x, xs.shape[1], TPB * cuda.gridDim.y):
        _load_block(x, m * k + b * QK, vals)
        _quantize_block_store(vals, xq, xs, m, b)


@cached_jit()
def _rmsnorm_quant_kernel(x, w, eps, xq, xs):
    """y = x / sqrt(mean(x^2) + eps) * w, quantized. x: [M, K] f32, w: [K] f32;
    grid (M, ceil(K/32/TPB)), block (TPB,)."""
    s_red = cuda.shared.array(TPB, dtype=np.float32)     # [TPB] partial sums of squares
    vals = cuda.local.array(QK, dtype=np.float32)        # [32] this thread's block of x, then of y
    w_vals = cuda.local.array(QK, dtype=np.float32)      # [32] the matching weights
    m = cuda.blockIdx.x
    k = x.shape[1]
    r = _row_rms_inverse(s_red, x, m, eps)
    for b in range(cuda.blockIdx.y * TPB + cuda.threadIdx.x, xs.shape[1], TPB * cuda.gridDim.y):
        _load_block(x, m * k + b * QK, vals)
        _load_block(w, b * QK, w_vals)
        for i in range(QK):
            vals[i] = (vals[i] * r) * w_vals[i]
        _quantize_block_store(vals, xq, xs, m, b)


@cached_jit()
def _silu_mul_quant_kernel(gu, xq, xs):
    """silu(gu[:, :F]) * gu[:, F:], quantized. gu: [M, 2F] f32 -> xq: [M, F] int8, xs: [M, F/32] f32;
    grid (M, ceil(F/32/TPB)), block (TPB,)."""
    vals = cuda.local.array(QK, dtype=np.float32)        # [32] gate, then silu(gate) * up
    up = cuda.local.array(QK, dtype=np.float32)          # [32] up
    m = cuda.blockIdx.x
    f = xq.shape[1]
    for b in range(cuda.blockIdx.y * TPB + cuda.threadIdx.x, xs.shape[1], TPB * cuda.gridDim.y):
        _load_block(gu, m * 2 * f + b * QK, vals)
        _load_block(gu, m * 2 * f + f + b * QK, up)
        for i in range(QK):
            vals[i] = _silu_mul(vals[i], up[i])
        _quantize_block_store(vals, xq, xs, m, b)


# ---------------------------------------------------------------- launchers ---------------------------

def _grid(m, k):
    return m, (k // QK + TPB - 1) // TPB


def quantize_rows(x, xq, xs, *, stream=0):
    """Quantize rows per 32-block. x: [M, K] float32; xq: [M, K] int8 (out); xs: [M, K/32] float32 (out)."""
    _quantize_rows_kernel[_grid(*x.shape), TPB, stream](x, xq, xs)


def rmsnorm_quant(x, w, eps, xq, xs, *, stream=0):
    """Fused RMSNorm + quantize. x: [M, K] float32; w: [K] float32 (the +1 already folded in);
    eps: float; xq: [M, K] int8 (out); xs: [M, K/32] float32 (out)."""
    _rmsnorm_quant_kernel[_grid(*x.shape), TPB, stream](x, w, np.float32(eps), xq, xs)


def silu_mul_quant(gu, xq, xs, *, stream=0):
    """Fused SiLU gating + quantize. gu: [M, 2F] float32 (gate columns [0, F), up columns [F, 2F));
    xq: [M, F] int8 (out); xs: [M, F/32] float32 (out)."""
    _silu_mul_quant_kernel[_grid(*xq.shape), TPB, stream](gu, xq, xs)
