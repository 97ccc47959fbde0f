"""Prefill GEMM on int8 tensor cores: ``mma.sync.m16n8k32`` s8 x s8 -> s32, sm_80+.

Same operands and result as q8/gemm.py (see there and q8/ref.py). The K step of one mma is 32, exactly
one Q8 block, so each mma's int32 result is that block's exact dot product S; it is scaled by
xs[m, b] * ws[n, b] and added to a float32 accumulator, in block order.

Tiling: a 128 (M) x 128 (N) output tile per 256-thread block; 8 warps as 2 (M) x 4 (N), each warp a
64 x 32 sub-tile = 4 m16 tiles x 4 n8 tiles = 16 mma per Q8 block and 64 float32 accumulators per lane.
K advances by KB = 2 Q8 blocks (64 bytes) per stage; stages are double-buffered in shared memory and
filled with 16-byte ``cp.async`` while the previous stage is multiplied. Block scales are read with
ordinary loads into registers during the stage and written to shared memory after it.

Shared rows are ROW_WORDS = 20 words (64 data bytes + 16 pad): the 8 consecutive rows one ldmatrix phase
reads then start in 8 different 4-bank groups (20 g mod 32 = 0, 20, 8, 28, 16, 4, 24, 12), so fragment
loads are conflict-free, and every row start stays 16-byte aligned for cp.async and ldmatrix.

int32 -> float32 without a conversion instruction: the mma's accumulator input C is 0x4B400000, so it
returns d = S + 0x4B400000 (exact: no int32 overflow for |S| <= 2^19). For |S| < 2^22 those bits are the
float 12582912 + S exactly (S lands in the mantissa of 1.5 * 2^23), and subtracting 12582912 is exact.
Per mma a lane then spends 12 float ops on its 4 results (sub, scale product, FMA) and no I2F
conversion (a lower-throughput pipe). With fragment loads and index math the sm_90a SASS has ~22
instructions per IMMA, so instruction issue, not the tensor core, bounds this kernel (~350 TOPS at 4
instructions per clock per SM, against ~700 for mma.sync alone).

Tails: rows past M or N are loaded from a clamped valid row and never stored; when K/32 is odd the
missing second block of the last stage is neither copied nor multiplied (uniform branch).
"""
import numpy as np
from numba import uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.q8.ref import QK

BM = 128                        # x rows (M) per block tile
BN = 128                        # weight rows (N) per block tile
KB = 2                          # Q8 blocks per pipeline stage
TPB = 256                       # 8 warps: 2 along M x 4 along N
ROW_WORDS = 20                  # shared words per tile row: KB * 8 data + 4 pad
STAGE_WORDS = BM * ROW_WORDS    # words per stage buffer (BM == BN)
TILE_WORDS = 2 * STAGE_WORDS    # both stage buffers (a plain constant: shared shapes must be literals)
SCALE_WORDS = 2 * KB * BM       # scales of both stage buffers: [buf, block, row] (BM == BN)
# <= 128 registers per thread (all used, no spills at sm_90a) so two blocks share an SM; the simulator's
# jit takes no launch_bounds
_OCCUPANCY = {} if SIMULATOR else {"launch_bounds": (TPB, 2)}
_F0 = np.float32(0.0)
_MAGIC_BITS = 0x4B400000              # bits of the float 1.5 * 2^23
_MAGIC = np.float32(12582912.0)       # 1.5 * 2^23


@cuda.jit(device=True, inline=True)
def _biased_to_f32(d):
    """S as float32 from d = S + 0x4B400000 (the mma's accumulator input adds the bias for free)."""
    return ptx.i32_as_f32(d) - _MAGIC


@cuda.jit(device=True, inline=True)
def _issue_stage(s_x, s_w, xq, wq, m0, n0, stage, buf):
    """cp.async stage ``stage`` (K bytes [64 stage, 64 stage + 64)) of both tiles into buffer ``buf``."""
    m_rows, k = xq.shape
    n_rows = wq.shape[0]
    tid = cuda.threadIdx.x
    for r in range(2):                              # 512 chunks of 16 B per tile: 2 per thread
        c = tid + TPB * r
        row = c >> 2
        part = c & 3
        kbyte = stage * (KB * QK) + part * 16
        if kbyte < k:
            dst = buf * STAGE_WORDS + row * ROW_WORDS + part * 4
            ptx.cp_async_16(s_x, dst, xq, min(m0 + row, m_rows - 1) * k + kbyte)
            ptx.cp_async_16(s_w, dst, wq, min(n0 + row, n_rows - 1) * k + kbyte)
    ptx.cp_async_commit()


@cuda.jit(device=True, inline=True)
def _load_scales(xs, ws, m0, n0, stage):
    """This thread's (xs, ws) values for stage ``stage``: tile row tid >> 1, block KB * stage + (tid & 1)."""
    m_rows, n_blocks = xs.shape
    n_rows = ws.shape[0]
    tid = cuda.threadIdx.x
    row = tid >> 1
    b = min(stage * KB + (tid & 1), n_blocks - 1)
    return xs[min(m0 + row, m_rows - 1), b], np.float32(ws[min(n0 + row, n_rows - 1), b])


@cuda.jit(device=True, inline=True)
def _mma_block(s_x, s_w, s_xs, s_ws, buf, kb, acc):
    """acc[i, j, :] += xs * ws * S for Q8 block kb of stage buffer buf, over the warp's 4 x 4 mma tiles.

    Fragments come from ldmatrix.x4: lane l addresses row l % 8 of 8x16-byte matrix q = l // 8, and gets
    word l % 4 of row l // 4 of every matrix, which for int8 is the m16n8k32 fragment layout. For A the four
    matrices are (rows +0, k 0-15), (rows +8, k 0-15), (rows +0, k 16-31), (rows +8, k 16-31) -> a0..a3;
    for B they are (n8 tile j, k 0-15), (j, k 16-31), (j + 1, k 0-15), (j + 1, k 16-31) -> b0, b1 of two tiles.
    """
    lane = cuda.threadIdx.x & 31
    warp = cuda.threadIdx.x >> 5
    g = lane >> 2                                   # fragment row group
    t = lane & 3                                    # fragment word within a 16-byte k half
    q = lane >> 3                                   # which of the four 8x16-byte matrices this lane addresses
    wm = (warp >> 2) * 64
    wn = (warp & 3) * 32
    base = buf * STAGE_WORDS + kb * 8
    # scales: flat [buf, block, row] arrays read at unsigned offsets (numba's signed 3-D indexing costs ~20
    # integer instructions per load here, a third of this loop's SASS)
    sbase = uint32((buf * KB + kb) * BM)
    b_frag = cuda.local.array((4, 2), dtype=np.uint32)      # [n8 tile, b0/b1]
    w_scale = cuda.local.array((4, 2), dtype=np.float32)    # [n8 tile, columns 2t / 2t+1]
    for jj in range(2):
        nrow = wn + (2 * jj + (q >> 1)) * 8 + (lane & 7)
        r0, r1, r2, r3 = ptx.ldmatrix_x4(s_w, base + nrow * ROW_WORDS + 4 * (q & 1))
        b_frag[2 * jj, 0] = r0
        b_frag[2 * jj, 1] = r1
        b_frag[2 * jj + 1, 0] = r2
        b_frag[2 * jj + 1, 1] = r3
    wcol = sbase + uint32(wn + 2 * t)
    for j in range(4):
        w_scale[j, 0] = s_ws[wcol + uint32(j * 8)]
        w_scale[j, 1] = s_ws[wcol + uint32(j * 8 + 1)]
    xrow = sbase + uint32(wm + g)
    for i in range(4):
        arow = wm + i * 16 + (lane & 7) + 8 * (q & 1)
        a0, a1, a2, a3 = ptx.ldmatrix_x4(s_x, base + arow * ROW_WORDS + 4 * (q >> 1))
        x_lo = s_xs[xrow + uint32(i * 16)]
        x_hi = s_xs[xrow + uint32(i * 16 + 8)]
        for j in range(4):
            d0, d1, d2, d3 = ptx.mma_s8_16832(a0, a1, a2, a3, b_frag[j, 0], b_frag[j, 1],
                                              _MAGIC_BITS, _MAGIC_BITS, _MAGIC_BITS, _MAGIC_BITS)
            acc[i, j, 0] += (x_lo * w_scale[j, 0]) * _biased_to_f32(d0)
            acc[i, j, 1] += (x_lo * w_scale[j, 1]) * _biased_to_f32(d1)
            acc[i, j, 2] += (x_hi * w_scale[j, 0]) * _biased_to_f32(d2)
            acc[i, j, 3] += (x_hi * w_scale[j, 1]) * _biased_to_f32(d3)


@cached_jit(**_OCCUPANCY)
def _gemm_q8_mma_kernel(wq, ws, xq, xs, out, accumulate):
    """wq: [N, K] int8, ws: [N, K/32] f16, xq: [M, K] int8, xs: [M, K/32] f32, out: [M, N] f32.
    grid (ceil(N / BN), ceil(M / BM)), block (TPB,)."""
    s_x = cuda.shared.array(TILE_WORDS, dtype=np.uint32, alignment=16)  # [2 bufs, BM rows, 20 words]
    s_w = cuda.shared.array(TILE_WORDS, dtype=np.uint32, alignment=16)  # [2 bufs, BN rows, 20 words]
    s_xs = cuda.shared.array(SCALE_WORDS, dtype=np.float32)     # [buf, block, row] x scales, flat
    s_ws = cuda.shared.array(SCALE_WORDS, dtype=np.float32)     # [buf, block, row] w scales, flat
    m_rows, k = xq.shape
    n_rows = wq.shape[0]
    n_blocks = k // QK
    n_stages = (n_blocks + KB - 1) // KB
    tid = cuda.threadIdx.x
    m0 = cuda.blockIdx.y * BM
    n0 = cuda.blockIdx.x * BN
    acc = cuda.local.array((4, 4, 4), dtype=np.float32)     # [m16 tile, n8 tile, fragment] accumulators
    for i in range(4):
        for j in range(4):
            for e in range(4):
                acc[i, j, e] = _F0

    _issue_stage(s_x, s_w, xq, wq, m0, n0, 0, 0)
    r_xs, r_ws = _load_scales(xs, ws, m0, n0, 0)
    s_xs[(tid & 1) * BM + (tid >> 1)] = r_xs
    s_ws[(tid & 1) * BM + (tid >> 1)] = r_ws
    for stage in range(n_stages):
        buf = stage & 1
        ptx.cp_async_wait_all()        # this thread's copies of `stage` have landed ...
        cuda.syncthreads()             # ... and everyone's; everyone also finished reading buf ^ 1
        has_next = stage + 1 < n_stages
        if has_next:
            _issue_stage(s_x, s_w, xq, wq, m0, n0, stage + 1, buf ^ 1)
            r_xs, r_ws = _load_scales(xs, ws, m0, n0, stage + 1)
        for kb in range(KB):
            if stage * KB + kb < n_blocks:
                _mma_block(s_x, s_w, s_xs, s_ws, buf, kb, acc)
        if has_next:                   # buf ^ 1's scales were last read before this stage's barrier
            s_xs[((buf ^ 1) * KB + (tid & 1)) * BM + (tid >> 1)] = r_xs
            s_ws[((buf ^ 1) * KB + (tid & 1)) * BM + (tid >> 1)] = r_ws

    lane = tid & 31
    warp = tid >> 5
    g = lane >> 2
    t = lane & 3
    for i in range(4):
        for half in range(2):          # fragment rows g (elements 0, 1) and g + 8 (elements 2, 3)
            m = m0 + (warp >> 2) * 64 + i * 16 + g + 8 * half
            if m < m_rows:
                for j in range(4):
                    n = n0 + (warp & 3) * 32 + j * 8 + 2 * t
                    if n < n_rows:     # N % 32 == 0 and n even, so n + 1 < N as well
                        v0 = acc[i, j, 2 * half]
                        v1 = acc[i, j, 2 * half + 1]
                        if accumulate:
                            v0 += out[m, n]
                            v1 += out[m, n + 1]
                        out[m, n] = v0
                        out[m, n + 1] = v1


def gemm_q8_mma(wq, ws, xq, xs, out, *, accumulate=False, stream=0):
    """Tensor-core GEMM (sm_80+). wq: [N, K] int8, ws: [N, K/32] float16, xq: [M, K] int8,
    xs: [M, K/32] float32, out: [M, N] float32 (written, or added to with accumulate=True)."""
    grid = ((wq.shape[0] + BN - 1) // BN, (xq.shape[0] + BM - 1) // BM)
    _gemm_q8_mma_kernel[grid, TPB, stream](wq, ws, xq, xs, out, 1 if accumulate else 0)
