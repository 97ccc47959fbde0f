"""Batched decode GEMV on Q8 weights, int8 tensor cores: out[b, n] (+)= sum_blk ws[n, blk] * xs[b, blk] * S
for B <= 16 activation rows (the active sequences of a batched decode step), every weight byte read once.

Layouts (q8/ref.py): wq int8 [N, K] row-major, ws float16 [N, K/32], xq int8 [B, K], xs float32 [B, K/32];
out float32 [B, N]. S is the exact int32 dot product of one Q8 block (32 bytes) of weight row n and row b.

Why tensor cores: the single-row GEMV (q8/gemv.py) spends 4 dp4a and a shuffle per 32 weight bytes; for B
rows a lane would also load B activation words per weight word, from L1, whose 128 bytes per clock and SM
would then cap the weight stream near 2 TB/s at B = 16. One ``mma.m16n8k32`` multiplies a 16-row Q8 block
of weights (512 bytes) by that block of 8 activation rows, each lane holding two 4-byte activation words.

Fragments: lane (g = lane >> 2, t = lane & 3) loads 8 bytes at byte 8t of the block from weight rows
n0 + g and n0 + g + 8 (a warp's load covers one whole 32-byte sector per row), and the same 8 bytes of
activation row g of each 8-row tile. The mma's fragment k order (a0 = A[g, 4t:4t+4], a2 = A[g, 16+4t:
20+4t], b0 = B[4t:4t+4, g], b1 = B[16+4t:20+4t, g]) gets physical bytes 8t..8t+3 in a0 and b0, 8t+4..8t+7
in a2 and b1: the same permutation of k on both sides, so the result is the block's exact S. The int32
result becomes float32 by the bias trick of q8/gemm_mma.py (C = 0x4B400000, |S| <= 2^19 < 2^22).

Work: a block of NW warps owns 16 weight rows; warp w takes the Q8 blocks w, w + NW, w + 2 NW, ... in
steps of UNROLL blocks whose loads are all issued before the step's first mma (a warp-uniform branch skips
blocks past K/32, after clamped loads). The warps' float32 sums meet in shared memory, warp 0 stores.
Grid ceil(N / 16) blocks. Rows past N and activation rows past B are loaded clamped and never stored.
Error: as the single-row GEMV's, q8.ref.q8_error_bound (any summation order of K/32 terms).

gemv_rows_q8 runs q8/gemv_rows_ring.py's kernel (weights streamed through shared memory by cp.async) where
K % 256 == 0, as on every model's shapes; this kernel is the path for the rest.
"""
from functools import lru_cache

import numpy as np
from numba import float32, uint64

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.q8.gemm_mma import _MAGIC_BITS, _biased_to_f32
from ninfer_numba.kernels.q8.gemv_rows_ring import STAGE_K, gemv_rows_ring_q8
from ninfer_numba.kernels.q8.ref import QK, q8_matmul_ref  # noqa: F401  (reference of this family)

NW = 8                       # warps per block, splitting K
ROWS = 16                    # weight rows per block (one m16 tile)
UNROLL = (8, 4)              # Q8 blocks per warp step for 1 and 2 activation tiles: 8 (4) x 512 weight
                             # bytes in flight per warp; 8 with two tiles spills at 128 registers (sm_90)
MAX_ROWS = 16                # activation rows: two n8 tiles at most
_OCCUPANCY = {} if SIMULATOR else {"launch_bounds": (32 * NW, 2)}


@lru_cache(maxsize=None)
def _gemv_rows_kernel(n_tiles: int, unroll: int):
    NACC = 4 * n_tiles           # accumulators per lane: rows g, g + 8 by columns 2t, 2t + 1, per tile

    @cached_jit(**_OCCUPANCY)
    def gemv_rows(wq, ws, xq, xs, out, accumulate):
        """wq: [N, K] int8, ws: [N, K/32] f16, xq: [B, K] int8, xs: [B, K/32] f32, out: [B, N] f32.
        grid (ceil(N / 16),), block (32 * NW,)."""
        s_red = cuda.shared.array((NW, NACC, 32), float32)      # [warp, accumulator, lane] partial sums
        n_rows = wq.shape[0]
        k = wq.shape[1]
        n_act = xq.shape[0]
        n_blk = k // QK
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        g = lane >> 2
        t = lane & 3
        n0 = cuda.blockIdx.x * ROWS
        row_lo = min(n0 + g, n_rows - 1)
        row_hi = min(n0 + g + 8, n_rows - 1)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        x_off = cuda.local.array(n_tiles, dtype=np.uint64)             # [tile] flat offset of row g's bytes
        x_col = cuda.local.array((n_tiles, 2), dtype=np.uint64)        # [tile, 2] rows 2t, 2t + 1 of xs
        for j in range(n_tiles):
            x_off[j] = uint64(min(8 * j + g, n_act - 1) * k + 8 * t)
            x_col[j, 0] = uint64(min(8 * j + 2 * t, n_act - 1))
            x_col[j, 1] = uint64(min(8 * j + 2 * t + 1, n_act - 1))
        a_words = cuda.local.array((unroll, 4), dtype=np.uint32)          # [unroll, 4] a0 a1 a2 a3
        b_words = cuda.local.array((unroll, n_tiles, 2), dtype=np.uint32)  # [unroll, tile, 2] b0 b1
        w_scale = cuda.local.array((unroll, 2), dtype=float32)          # [unroll, 2] rows g, g + 8
        x_scale = cuda.local.array((unroll, n_tiles, 2), dtype=float32)  # [unroll, tile, 2] cols 2t, 2t+1
        # unsigned flat offsets, computed once: signed ones cost numba's negative-index fix-up per access
        w_lo = uint64(row_lo * k + 8 * t)
        w_hi = uint64(row_hi * k + 8 * t)
        u_lo = uint64(row_lo)
        u_hi = uint64(row_hi)
        n_steps = (n_blk + NW * unroll - 1) // (NW * unroll)
        for step in range(n_steps):
            for u in range(unroll):                                    # every load of the step first
                blk = warp + NW * (step * unroll + u)
                ublk = uint64(blk if blk < n_blk else 0)
                lo = ptx.ldg_nc_v2_u32(wq, w_lo + ublk * uint64(QK))
                hi = ptx.ldg_nc_v2_u32(wq, w_hi + ublk * uint64(QK))
                a_words[u, 0] = lo[0]
                a_words[u, 1] = hi[0]
                a_words[u, 2] = lo[1]
                a_words[u, 3] = hi[1]
                w_scale[u, 0] = float32(ws[u_lo, ublk])
                w_scale[u, 1] = float32(ws[u_hi, ublk])
                for j in range(n_tiles):
                    xv = ptx.ldg_nc_v2_u32(xq, x_off[j] + ublk * uint64(QK))
                    b_words[u, j, 0] = xv[0]
                    b_words[u, j, 1] = xv[1]
                    x_scale[u, j, 0] = xs[x_col[j, 0], ublk]
                    x_scale[u, j, 1] = xs[x_col[j, 1], ublk]
            for u in range(unroll):
                if warp + NW * (step * unroll + u) < n_blk:             # warp-uniform
                    for j in range(n_tiles):
                        d0, d1, d2, d3 = ptx.mma_s8_16832(
                            a_words[u, 0], a_words[u, 1], a_words[u, 2], a_words[u, 3],
                            b_words[u, j, 0], b_words[u, j, 1], _MAGIC_BITS, _MAGIC_BITS, _MAGIC_BITS, _MAGIC_BITS)
                        acc[4 * j] += (w_scale[u, 0] * x_scale[u, j, 0]) * _biased_to_f32(d0)
                        acc[4 * j + 1] += (w_scale[u, 0] * x_scale[u, j, 1]) * _biased_to_f32(d1)
                        acc[4 * j + 2] += (w_scale[u, 1] * x_scale[u, j, 0]) * _biased_to_f32(d2)
                        acc[4 * j + 3] += (w_scale[u, 1] * x_scale[u, j, 1]) * _biased_to_f32(d3)
        for i in range(NACC):
            s_red[warp, i, lane] = acc[i]
        cuda.syncthreads()
        if warp == 0:
            for i in range(NACC):
                tot = float32(0.0)
                for w in range(NW):
                    tot += s_red[w, i, lane]
                row = n0 + g + 8 * ((i >> 1) & 1)
                col = 8 * (i >> 2) + 2 * t + (i & 1)
                if row < n_rows and col < n_act:
                    out[col, row] = tot + out[col, row] if accumulate else tot

    return gemv_rows


def _aligned16(a) -> bool:
    """The array's first byte is 16-byte aligned (the simulator's twins check offsets within the array)."""
    return SIMULATOR or a.device_ctypes_pointer.value % 16 == 0


def gemv_rows_q8(wq, ws, xq, xs, out, *, accumulate=False, unroll=None, impl=None, stream=0):
    """out = x W^T (or out += x W^T) for B <= 16 activation rows. wq: [N, K] int8, ws: [N, K/32] float16,
    xq: [B, K] int8, xs: [B, K/32] float32, out: [B, N] float32. K % 32 == 0; wq and xq start 8-byte aligned
    (device allocations are 256-byte aligned). impl: "ring" (q8/gemv_rows_ring.py: K % 256 == 0 and every
    input 16-byte aligned), "tiles" (this file's kernel) or None: the ring wherever it applies."""
    n_rows, k = wq.shape
    n_act = xq.shape[0]
    if not 1 <= n_act <= MAX_ROWS:
        raise ValueError(f"gemv_rows_q8 takes 1 to {MAX_ROWS} activation rows, got {n_act}")
    if k % QK or xq.shape[1] != k or out.shape != (n_act, n_rows):
        raise ValueError(f"shapes: wq {wq.shape}, xq {xq.shape}, out {out.shape} (K a multiple of {QK})")
    ring_ok = k % STAGE_K == 0 and all(_aligned16(a) for a in (wq, ws, xq, xs))
    if impl == "ring" and not ring_ok:
        raise ValueError(f"the ring kernel needs K % {STAGE_K} == 0 and 16-byte aligned inputs (K {k})")
    if impl == "ring" or impl is None and ring_ok:
        gemv_rows_ring_q8(wq, ws, xq, xs, out, accumulate=accumulate, stream=stream)
        return
    n_tiles = (n_act + 7) // 8
    kernel = _gemv_rows_kernel(n_tiles, unroll or UNROLL[n_tiles - 1])
    kernel[(n_rows + ROWS - 1) // ROWS, 32 * NW, stream](wq, ws, xq, xs, out, 1 if accumulate else 0)
