"""Prefill GEMM on Q8 operands: out[m, n] (+)= sum_b ws[n, b] * xs[m, b] * S[m, n, b].

Layouts (q8/ref.py): wq int8 [N, K], ws float16 [N, K/32], xq int8 [M, K], xs float32 [M, K/32],
out float32 [M, N]. M is arbitrary; N and K are multiples of 32.

Two kernels, one chooser (``gemm_q8``):
- dp4a (here): any sm_61+ GPU and the CUDA simulator. A 64 x 64 output tile per 256-thread block,
  4 x 4 outputs per thread, K consumed one Q8 block (32 bytes) at a time through shared memory.
- mma (q8/gemm_mma.py): int8 tensor cores, sm_80+; the fast path on the H200.

Both compute each block's dot product S exactly in int32 and add (float(ws) * xs) * float(S) to a
float32 accumulator in block order, so the error bound is q8.ref.q8_error_bound.
"""
import functools

import numpy as np

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.q8.gemm_mma import gemm_q8_mma
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.q8.ref import QK, q8_matmul_ref  # noqa: F401  (reference of this family)

BM = 64                      # x rows (M) per block tile
BN = 64                      # weight rows (N) per block tile
TPB = 256                    # threads: 16 x 16, each 4 x 4 outputs strided by 16
WPAD = 9                     # words per shared row: 8 words of a Q8 block + 1 so 16 rows hit 16 banks
_F0 = np.float32(0.0)


@cached_jit()
def _gemm_q8_dp4a_kernel(wq, ws, xq, xs, out, accumulate):
    """wq: [N, K] int8, ws: [N, K/32] f16, xq: [M, K] int8, xs: [M, K/32] f32, out: [M, N] f32.
    grid (ceil(N / BN), ceil(M / BM)), block (TPB,)."""
    s_x = cuda.shared.array((BM, WPAD), dtype=np.uint32)     # [BM, 8 (+1 pad)] x block words
    s_w = cuda.shared.array((BN, WPAD), dtype=np.uint32)     # [BN, 8 (+1 pad)] weight block words
    s_xs = cuda.shared.array(BM, dtype=np.float32)           # [BM] x block scales
    s_ws = cuda.shared.array(BN, dtype=np.float32)           # [BN] weight block scales
    m_rows, k = xq.shape
    n_rows = wq.shape[0]
    n_blocks = k // QK
    tid = cuda.threadIdx.x
    tx = tid & 15                      # output columns n0 + tx + 16 j
    ty = tid >> 4                      # output rows    m0 + ty + 16 i
    m0 = cuda.blockIdx.y * BM
    n0 = cuda.blockIdx.x * BN
    # staging roles: threads 0..127 copy x (64 rows x two 16-byte halves), 128..255 copy w
    st_row = (tid & 127) >> 1
    st_half = tid & 1
    st_is_x = tid < 128
    # rows past M or N read a clamped valid row; their results are never stored
    src_row = min(m0 + st_row, m_rows - 1) if st_is_x else min(n0 + st_row, n_rows - 1)
    acc = cuda.local.array((4, 4), dtype=np.float32)          # [4 rows, 4 cols] accumulators
    for i in range(4):
        for j in range(4):
            acc[i, j] = _F0
    r_x = cuda.local.array((4, 8), dtype=np.uint32)           # [4 rows, 8 words] this thread's x rows
    r_w = cuda.local.array((4, 8), dtype=np.uint32)           # [4 cols, 8 words] this thread's w rows
    for b in range(n_blocks):
        flat = src_row * k + b * QK + st_half * 16
        v = ptx.ldg_nc_v4_u32(xq, flat) if st_is_x else ptx.ldg_nc_v4_u32(wq, flat)
        for e in range(4):
            if st_is_x:
                s_x[st_row, st_half * 4 + e] = v[e]
            else:
                s_w[st_row, st_half * 4 + e] = v[e]
        if tid < BM:
            s_xs[tid] = xs[min(m0 + tid, m_rows - 1), b]
        elif tid < BM + BN:
            s_ws[tid - BM] = np.float32(ws[min(n0 + tid - BM, n_rows - 1), b])
        cuda.syncthreads()
        for i in range(4):
            for e in range(8):
                r_x[i, e] = s_x[ty + 16 * i, e]
                r_w[i, e] = s_w[tx + 16 * i, e]
        for i in range(4):
            for j in range(4):
                s = 0
                for e in range(8):
                    s = ptx.dp4a(r_x[i, e], r_w[j, e], s)
                acc[i, j] += (s_ws[tx + 16 * j] * s_xs[ty + 16 * i]) * np.float32(s)
        cuda.syncthreads()             # the next block overwrites s_x / s_w
    for i in range(4):
        m = m0 + ty + 16 * i
        for j in range(4):
            n = n0 + tx + 16 * j
            if m < m_rows and n < n_rows:
                out[m, n] = acc[i, j] + out[m, n] if accumulate else acc[i, j]


def gemm_q8_dp4a(wq, ws, xq, xs, out, *, accumulate=False, stream=0):
    """dp4a tiled GEMM. wq: [N, K] int8, ws: [N, K/32] float16, xq: [M, K] int8, xs: [M, K/32] float32,
    out: [M, N] float32 (written, or added to with accumulate=True)."""
    grid = ((wq.shape[0] + BN - 1) // BN, (xq.shape[0] + BM - 1) // BM)
    _gemm_q8_dp4a_kernel[grid, TPB, stream](wq, ws, xq, xs, out, 1 if accumulate else 0)


@functools.lru_cache(maxsize=None)
def _has_int8_mma() -> bool:
    """int8 mma.sync m16n8k32 needs sm_80+ (checked once: every GPU of a run is assumed the same kind);
    under the simulator "auto" takes dp4a, the tensor-core path being a slow warp emulation there."""
    if SIMULATOR:
        return False
    return cuda.get_current_device().compute_capability >= (8, 0)


def gemm_q8(wq, ws, xq, xs, out, *, accumulate=False, path="auto", stream=0):
    """out (+)= xq·wq^T with Q8 block scales; path "auto" (mma on sm_80+, else dp4a), "dp4a" or "mma".

    wq: [N, K] int8, ws: [N, K/32] float16, xq: [M, K] int8, xs: [M, K/32] float32, out: [M, N] float32.
    """
    if path == "auto":
        path = "mma" if _has_int8_mma() else "dp4a"
    if path == "mma":
        gemm_q8_mma(wq, ws, xq, xs, out, accumulate=accumulate, stream=stream)
    elif path == "dp4a":
        gemm_q8_dp4a(wq, ws, xq, xs, out, accumulate=accumulate, stream=stream)
    else:
        raise ValueError(f"unknown GEMM path {path!r}; expected 'auto', 'dp4a' or 'mma'")
