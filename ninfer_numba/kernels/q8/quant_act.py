"""Activation quantizers that feed every Q8 GEMV/GEMM: plain, fused with RMSNorm, fused with SiLU-gating,
fused with the GDN output's gated RMSNorm (per head, gated by silu(z)).

Output layout (see q8/ref.py): ``xq: int8 [M, K]`` and ``xs: float32 [M, K/32]`` per 32-block.
Grid (M, Y), block (TPB,) = WARPS warps: a warp owns one 32-block at a time, lane l element l (one coalesced
128-byte load, a 5-shuffle absmax, one division per lane, one 32-byte store), and the Y blocks of row m take
its 32-blocks blockIdx.y·WARPS + warp, then + Y·WARPS, ... Y = min(ceil(K/32 / WARPS), ceil(SPREAD / M)):
a decode row (M = 1) is spread over up to K/128 blocks, so no thread walks a chain of dependent loads (the
thread-per-block layout before took 7.6 µs per 9B decode RMSNorm, nearly all of it load latency). RMSNorm
needs the whole row's sum of squares, so each of a row's Y blocks computes it (the row is at most 70 KB and
sits in L2): 16-byte loads, UNROLL of them in flight per thread, before quantizing its own 32-blocks.
Inputs must be C-contiguous with 16-byte aligned rows (K % 32 == 0 and an aligned base).

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
from functools import lru_cache

import numpy as np

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.gdn.device_math import gated_rms_apply, gated_rms_inverse
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.q8.ref import (QK, quantize_q8_blocks_ref, rmsnorm_quant_ref,  # noqa: F401
                                            silu_mul_quant_ref)
from ninfer_numba.kernels.reduce import row_max_f32, row_sum_f32

TPB = 128                       # threads per thread block
WARPS = TPB // 32               # 32-blocks a thread block quantizes at a time (one per warp)
SPREAD = 256                    # rows x slices aimed for when M is small (a decode row: up to K/128 blocks)
UNROLL = 8                      # 16-byte loads in flight per thread in a row's sum of squares
RMS_VALS = 4 * UNROLL           # local-array sizes must be plain constants on the GPU (the simulator takes any)
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
def _quantize_lane_store(v, xq, xs, m, b, lane):
    """Quantize block b of row m, whose element ``lane`` this lane holds as v, into xq[m, 32 b + lane] and
    xs[m, b]. Every lane of the warp calls it (the absmax is a butterfly over the 32 lanes)."""
    amax = row_max_f32(abs(v), 32)
    d = _scale_of(amax)
    if lane == 0:
        xs[m, b] = d
    xq[m, b * QK + lane] = _quant_one(v, d) if amax > _F0 else 0


@cuda.jit(device=True, inline=True)
def _row_rms_inverse(s_red, x, m, eps):
    """1 / sqrt(mean(x[m]^2) + eps) for row m of x [M, K] float32 (K % 4 == 0, 16-byte aligned rows), over
    the block's TPB threads; s_red: shared float32 [>= WARPS]. Thread t sums the 4-element chunks t, t + TPB,
    ... in a fixed order (UNROLL 16-byte loads issued before the first use), then a butterfly per warp and the
    WARPS warp sums in order: every kernel that normalizes a row calls this, so their float32 results agree
    bit for bit, and every block of a row gets the same value."""
    k = x.shape[1]
    tid = cuda.threadIdx.x
    n4 = k // 4
    vals = cuda.local.array(RMS_VALS, dtype=np.float32)      # [UNROLL, 4] this round's chunks (registers)
    ss = _F0
    for c0 in range(tid, n4, TPB * UNROLL):
        for u in range(UNROLL):
            c = c0 + u * TPB
            if c < n4:
                w = ptx.ldg_nc_v4_u32(x, m * k + 4 * c)
                for e in range(4):
                    vals[4 * u + e] = ptx.i32_as_f32(w[e])
            else:
                for e in range(4):
                    vals[4 * u + e] = _F0
        for i in range(4 * UNROLL):
            ss += vals[i] * vals[i]
    ss = row_sum_f32(ss, 32)
    if tid % 32 == 0:
        s_red[tid // 32] = ss
    cuda.syncthreads()
    total = _F0
    for j in range(WARPS):
        total += s_red[j]
    cuda.syncthreads()                                        # s_red is free again
    return _F1 / math.sqrt(total / np.float32(k) + eps)


@cuda.jit(device=True, inline=True)
def _silu_mul(g, u):
    return g / (_F1 + math.exp(-g)) * u


# ---------------------------------------------------------------- kernels -----------------------------

@cached_jit(pdl=True)
def _quantize_rows_kernel(x, xq, xs):
    """x: [M, K] float32 -> xq: [M, K] int8, xs: [M, K/32] float32; grid (M, Y), block (TPB,)."""
    griddep_wait()                                # kernels/pdl.py: before any global access
    griddep_launch_dependents()
    m = cuda.blockIdx.x
    lane = cuda.threadIdx.x % 32
    for b in range(cuda.blockIdx.y * WARPS + cuda.threadIdx.x // 32, xs.shape[1], WARPS * cuda.gridDim.y):
        _quantize_lane_store(x[m, b * QK + lane], xq, xs, m, b, lane)


@cached_jit(pdl=True)
def _rmsnorm_quant_kernel(x, w, eps, xq, xs):
    """y = x / sqrt(mean(x^2) + eps) * w, quantized. x: [M, K] f32, w: [K] f32; grid (M, Y), block (TPB,).
    The warp's first element and weight are loaded before the row's sum of squares (a decode row gives each
    warp one 32-block), so only the sum's loads stand between the launch and the quantization."""
    griddep_wait()                                # kernels/pdl.py: before any global access
    griddep_launch_dependents()
    s_red = cuda.shared.array(WARPS, dtype=np.float32)   # [WARPS] the warps' sums of squares
    m = cuda.blockIdx.x
    lane = cuda.threadIdx.x % 32
    b0 = cuda.blockIdx.y * WARPS + cuda.threadIdx.x // 32
    i0 = b0 * QK + lane if b0 < xs.shape[1] else lane
    x0 = x[m, i0]
    w0 = w[i0]
    r = _row_rms_inverse(s_red, x, m, eps)
    for b in range(b0, xs.shape[1], WARPS * cuda.gridDim.y):
        i = b * QK + lane
        xv = x0 if b == b0 else x[m, i]
        wv = w0 if b == b0 else w[i]
        _quantize_lane_store((xv * r) * wv, xq, xs, m, b, lane)


@cached_jit(pdl=True)
def _silu_mul_quant_kernel(gu, xq, xs):
    """silu(gu[:, :F]) * gu[:, F:], quantized. gu: [M, 2F] f32 -> xq: [M, F] int8, xs: [M, F/32] f32;
    grid (M, Y), block (TPB,)."""
    griddep_wait()                                # kernels/pdl.py: before any global access
    griddep_launch_dependents()
    m = cuda.blockIdx.x
    lane = cuda.threadIdx.x % 32
    f = xq.shape[1]
    for b in range(cuda.blockIdx.y * WARPS + cuda.threadIdx.x // 32, xs.shape[1], WARPS * cuda.gridDim.y):
        i = b * QK + lane
        _quantize_lane_store(_silu_mul(gu[m, i], gu[m, f + i]), xq, xs, m, b, lane)


@lru_cache(maxsize=None)
def _gated_rmsnorm_quant_kernel(S: int):
    NL = min(S, QK)             # lanes of a warp per head
    PER = S // NL               # elements of the head per lane (loads issued together)

    @cached_jit(pdl=True)
    def gated_rmsnorm_quant(y, proj, z0, norm_w, eps, xq, xs):
        """y: [M, Hv*S] f32 raw GDN output, proj: [M, P] f32 (z of element e at column z0 + e), norm_w: [S] f32
        -> RMSNorm(y per head of S) * norm_w * silu(z), quantized into xq: [M, Hv*S] int8, xs: [M, Hv*S/32]
        f32; grid (M, Y), block (TPB,). A warp's 32-block lies in one head (S % 32 == 0) or holds 32 / S whole
        heads; each warp sums its head's squares itself (NL lanes per head, the same order in every warp)."""
        griddep_wait()                                # kernels/pdl.py: before any global access
        griddep_launch_dependents()
        m = cuda.blockIdx.x
        lane = cuda.threadIdx.x % 32
        vals = cuda.local.array(PER, dtype=np.float32)    # [PER] this lane's elements of the head
        for b in range(cuda.blockIdx.y * WARPS + cuda.threadIdx.x // 32, xs.shape[1], WARPS * cuda.gridDim.y):
            e = b * QK + lane
            h0 = (e // S) * S
            z = proj[m, z0 + e]
            wv = norm_w[e - h0]
            for t in range(PER):
                vals[t] = y[m, h0 + lane % NL + NL * t]
            ss = _F0
            for t in range(PER):
                ss += vals[t] * vals[t]
            ss = row_sum_f32(ss, NL)
            _quantize_lane_store(gated_rms_apply(y[m, e], gated_rms_inverse(ss, S, eps), wv, z), xq, xs, m, b, lane)

    return gated_rmsnorm_quant


# ---------------------------------------------------------------- launchers ---------------------------

def _grid(m, k):
    """(M, Y) of the module docstring; M == 0 gives no launch (the launchers return first)."""
    per_row = (k // QK + WARPS - 1) // WARPS
    return m, max(1, min(per_row, (SPREAD + m - 1) // m))


def quantize_rows(x, xq, xs, *, stream=0):
    """Quantize rows per 32-block. x: [M, K] float32; xq: [M, K] int8 (out); xs: [M, K/32] float32 (out)."""
    if x.shape[0] == 0:
        return
    _quantize_rows_kernel[_grid(*x.shape), TPB, stream](x, xq, xs)


def rmsnorm_quant(x, w, eps, xq, xs, *, stream=0):
    """Fused RMSNorm + quantize. x: [M, K] float32; w: [K] float32 (the +1 already folded in);
    eps: float; xq: [M, K] int8 (out); xs: [M, K/32] float32 (out)."""
    if x.shape[0] == 0:
        return
    _rmsnorm_quant_kernel[_grid(*x.shape), TPB, stream](x, w, np.float32(eps), xq, xs)


def silu_mul_quant(gu, xq, xs, *, stream=0):
    """Fused SiLU gating + quantize. gu: [M, 2F] float32 (gate columns [0, F), up columns [F, 2F));
    xq: [M, F] int8 (out); xs: [M, F/32] float32 (out)."""
    if xq.shape[0] == 0:
        return
    _silu_mul_quant_kernel[_grid(*xq.shape), TPB, stream](gu, xq, xs)


def gated_rmsnorm_quant(y, proj, z0: int, norm_w, eps, xq, xs, *, stream=0):
    """Fused GDN gated RMSNorm + quantize. y: [M, Hv*S] float32 raw o (gdn_decode_step, normalize=False);
    proj: [M, P] float32 with z at columns [z0, z0 + Hv*S); norm_w: [S] float32 (S % 32 == 0 or 32 % S == 0);
    eps: float; xq: [M, Hv*S] int8 (out); xs: [M, Hv*S/32] float32 (out)."""
    S = norm_w.shape[0]
    if S % QK and QK % S:
        raise ValueError(f"gated_rmsnorm_quant: head size {S} must divide or be a multiple of {QK}")
    if y.shape[0] == 0:
        return
    _gated_rmsnorm_quant_kernel(S)[_grid(*y.shape), TPB, stream](y, proj, np.int32(z0), norm_w, np.float32(eps),
                                                                  xq, xs)
