"""Batched decode GEMV on Q8 weights, second version: each warp streams its weights through a ring of
shared-memory stages filled by cp.async, so the bytes in flight are set by shared memory, not registers.

out[b, n] (+)= sum_blk ws[n, blk] * xs[b, blk] * S for B <= 16 activation rows; the same product, layouts
and fragments as q8/gemv_rows.py (whose docstring has the mma fragment mapping and the bias trick), which
stays the path for K % 256 != 0.

Why (benchmarks/NOTES.md, session 14): the first version reached 31-41 % of copy bandwidth at B = 16. Its
loads went to registers (about 64 KB per SM in flight at best), each warp-load touched 16 rows x 32 bytes,
and every block ran two load rounds between its launch and its reduction. Here:

- A warp owns one 16-row tile and a range of K (split s of S); its copies read whole 256-byte row pieces
  (two 128-byte lines: one cp.async instruction covers 2 rows x 256 bytes).
- Stage = 256 bytes of K (8 Q8 blocks): weights [16 rows, 256 B], the activation rows [XR rows, 256 B]
  (XR = 8 per n8 tile, rows past B not loaded: their columns are never stored), the weight scales
  [16 rows, 8 f16] and activation scales [XR rows, 8 f32] (16-byte pieces: K % 256 == 0).
- Shared rows are 288 bytes apart (256 + 32): the 8-byte fragment reads of rows g = 0..3 of a half-warp
  land on banks 8g + 2t, 8g + 2t + 1: no conflicts.
- STAGES slots per warp: copies of stage i + STAGES - 1 are issued before stage i is computed, so
  STAGES - 1 stages per warp are always on their way. Only the warp's own barrier (syncwarp) orders its
  lanes' copies with its reads; warps never wait for each other until the split-K reduction.
- Splits S (warps per tile, S divides the block's warps) are chosen per shape so that the blocks fill about
  two waves of the SMs' block slots (as many blocks per SM as their rings fit) and each split keeps several
  stages (choose_splits). The S partial sums meet in shared memory, in split order (deterministic).

Buffers: wq int8 [N, K], ws f16 [N, K/32], xq int8 [B, K], xs f32 [B, K/32], out f32 [B, N]; all four
inputs 16-byte aligned at row 0 (device allocations are), K % 256 == 0.
Shared memory (dynamic): warp w's ring at byte w * STAGES * SLOT, slot layout
  [0, 16*ROW)          weights, row r at r * ROW              (int8 [16, 256] + pad)
  [X_OFF, +XR*ROW)     activations, row b at X_OFF + b * ROW   (int8 [XR, 256] + pad)
  [WS_OFF, +256)       weight scales, row r at WS_OFF + 16 r   (f16 [16, 8])
  [XS_OFF, +XR*32)     activation scales, row b at XS_OFF + 32 b (f32 [XR, 8])
then reused, after every warp is done, for the [warps, NACC, 32] f32 partial sums when S > 1.
Error: as gemv_rows (q8.ref.q8_error_bound).
"""
from functools import lru_cache

from numba import float32, types, uint32, uint64

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.dynamic_smem import allow_dynamic_smem
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, sm_count
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.ptx_sm90 import cp_async_16b
from ninfer_numba.kernels.q8.gemm_mma import _MAGIC_BITS, _biased_to_f32

STAGE_K = 256                # K bytes per stage: 8 Q8 blocks, one 16-byte piece of each scale row
ROW = STAGE_K + 32           # shared bytes between rows of a stage (bank-conflict-free fragment reads)
# (warps per block, stages per warp) by activation tiles. Measured on the 9B shapes (bench_gemm --only
# sweep, NOTES session 15): 2 stages beat 3, and 4-warp blocks (3 per SM at one activation tile, 2 at two)
# beat 8-warp ones at B = 8 (gate|up 35.9 against 39.0 us) and mostly at 16: the kernel waits on its warps'
# shared reads and mmas more than on memory, so warps count more than stages in flight
CONFIG = {1: (4, 2), 2: (4, 2)}
SMEM_PER_SM = 228 * 1024     # Hopper: shared memory per SM (each block also reserves 1 KB)
MIN_SPLIT_STAGES = 4         # a split shorter than this spends too much of itself filling its ring
MIN_WAVES = 1.9              # warps per SM slot wanted: one wave of long splits lost to two of half length
_LO = uint64(0xFFFFFFFF)


def slot_bytes(n_tiles: int) -> int:
    """Shared bytes of one stage of one warp (module docstring's slot layout)."""
    xr = 8 * n_tiles
    return 16 * ROW + xr * ROW + 16 * 16 + xr * 32


def smem_bytes(n_tiles: int, warps: int, stages: int) -> int:
    return max(warps * stages * slot_bytes(n_tiles), warps * 4 * n_tiles * 32 * 4)


def blocks_per_sm(n_tiles: int, warps: int, stages: int) -> int:
    return max(1, SMEM_PER_SM // (smem_bytes(n_tiles, warps, stages) + 1024))


def choose_splits(n_rows: int, k: int, warps: int, stages: int, n_sm: int, n_tiles: int = 1) -> int:
    """Warps per tile: the fewest splits S (S divides the block's warps, each split at least MIN_SPLIT_STAGES
    stages of K) whose blocks fill MIN_WAVES waves of the SMs' block slots, else the most allowed. Measured
    (NOTES session 15): gate|up at one wave unsplit 46.0 us, at two waves of 2 splits 35.9."""
    tiles, n_st = -(-n_rows // 16), k // STAGE_K
    slots = n_sm * blocks_per_sm(n_tiles, warps, stages)
    allowed = [s for s in range(1, warps + 1) if warps % s == 0 and (s == 1 or n_st // s >= MIN_SPLIT_STAGES)]
    for s in allowed:
        if -(-tiles // (warps // s)) >= MIN_WAVES * slots:
            return s
    return allowed[-1]


@lru_cache(maxsize=None)
def _ring_kernel(n_tiles: int, warps: int, stages: int, splits: int):
    XR = 8 * n_tiles                 # activation rows in a stage
    NACC = 4 * n_tiles               # accumulators per lane: rows g, g + 8 by columns 2t, 2t + 1, per tile
    X_OFF = 16 * ROW
    WS_OFF = X_OFF + XR * ROW
    XS_OFF = WS_OFF + 16 * 16
    SLOT = XS_OFF + XR * 32
    TILES_PER_BLOCK = warps // splits
    occupancy = {} if SIMULATOR else {"launch_bounds": (32 * warps, blocks_per_sm(n_tiles, warps, stages))}

    @cuda.jit(device=True, inline=True)
    def issue(smem, dst, st, wq, ws, xq, xs, tile, lane, n_rows, k, n_act):
        """This lane's copies of stage st (K bytes [256 st, 256 st + 256)) into the slot at byte dst."""
        half, col = lane >> 4, uint64(16 * (lane & 15))
        k0 = uint64(st) * uint64(STAGE_K)
        for i in range(8):                          # weights: rows 2i + half, 16 bytes at col
            r = 2 * i + half
            row = uint64(min(16 * tile + r, n_rows - 1))
            cp_async_16b(smem, dst + uint32(r * ROW) + uint32(col), wq, row * uint64(k) + k0 + col)
        for i in range(XR // 2):                    # activations: rows 2i + half that exist
            r = 2 * i + half
            if r < n_act:
                cp_async_16b(smem, dst + uint32(X_OFF + r * ROW) + uint32(col), xq,
                             uint64(r) * uint64(k) + k0 + col)
        kb = uint64(k // 32)                        # scale row length
        if lane < 16:                               # weight scales: 8 f16 of row `lane`
            row = uint64(min(16 * tile + lane, n_rows - 1))
            cp_async_16b(smem, dst + uint32(WS_OFF + 16 * lane), ws, row * kb + uint64(8 * st))
        r = lane >> 1
        if r < XR and r < n_act:                    # activation scales: 4 f32 (half lane & 1) of row r
            cp_async_16b(smem, dst + uint32(XS_OFF + 32 * r + 16 * (lane & 1)), xs,
                         uint64(r) * kb + uint64(8 * st + 4 * (lane & 1)))

    @cuda.jit(device=True, inline=True)
    def block(smem64, smem_h, smem_f, src, g, t, acc, u):
        """Q8 block u of the slot at byte src into this lane's accumulators (one mma per activation tile)."""
        wlo = smem64[(src + uint32(g * ROW + 32 * u + 8 * t)) >> 3]
        whi = smem64[(src + uint32((g + 8) * ROW + 32 * u + 8 * t)) >> 3]
        s_lo = float32(smem_h[(src + uint32(WS_OFF + 16 * g + 2 * u)) >> 1])
        s_hi = float32(smem_h[(src + uint32(WS_OFF + 16 * (g + 8) + 2 * u)) >> 1])
        for j in range(n_tiles):
            xv = smem64[(src + uint32(X_OFF + (8 * j + g) * ROW + 32 * u + 8 * t)) >> 3]
            x0 = smem_f[(src + uint32(XS_OFF + 32 * (8 * j + 2 * t) + 4 * u)) >> 2]
            x1 = smem_f[(src + uint32(XS_OFF + 32 * (8 * j + 2 * t + 1) + 4 * u)) >> 2]
            d0, d1, d2, d3 = ptx.mma_s8_16832(
                uint32(wlo & _LO), uint32(whi & _LO), uint32(wlo >> uint64(32)), uint32(whi >> uint64(32)),
                uint32(xv & _LO), uint32(xv >> uint64(32)), _MAGIC_BITS, _MAGIC_BITS, _MAGIC_BITS, _MAGIC_BITS)
            acc[4 * j] += (s_lo * x0) * _biased_to_f32(d0)
            acc[4 * j + 1] += (s_lo * x1) * _biased_to_f32(d1)
            acc[4 * j + 2] += (s_hi * x0) * _biased_to_f32(d2)
            acc[4 * j + 3] += (s_hi * x1) * _biased_to_f32(d3)

    @cuda.jit(device=True, inline=True)
    def compute(smem64, smem_h, smem_f, src, g, t, acc):
        """The slot's 8 Q8 blocks, written out: with u a constant in each, every shared address is a register
        plus an immediate and ptxas may hoist all the stage's reads ahead of its mmas (a loop over u was kept
        rolled, each block's reads, mma and sums one dependent chain)."""
        block(smem64, smem_h, smem_f, src, g, t, acc, 0)
        block(smem64, smem_h, smem_f, src, g, t, acc, 1)
        block(smem64, smem_h, smem_f, src, g, t, acc, 2)
        block(smem64, smem_h, smem_f, src, g, t, acc, 3)
        block(smem64, smem_h, smem_f, src, g, t, acc, 4)
        block(smem64, smem_h, smem_f, src, g, t, acc, 5)
        block(smem64, smem_h, smem_f, src, g, t, acc, 6)
        block(smem64, smem_h, smem_f, src, g, t, acc, 7)

    @cached_jit(pdl=True, **occupancy)
    def gemv_rows_ring(wq, ws, xq, xs, out, accumulate):
        """wq: [N, K] int8, ws: [N, K/32] f16, xq: [B, K] int8, xs: [B, K/32] f32, out: [B, N] f32.
        grid (ceil(ceil(N / 16) / TILES_PER_BLOCK),), block (32 * warps,), dynamic smem smem_bytes(...)."""
        smem = cuda.shared.array(0, types.uint32, alignment=16)     # cp.async target (byte offsets)
        smem64 = cuda.shared.array(0, types.uint64, alignment=16)   # the same bytes: 8-byte fragment reads
        smem_h = cuda.shared.array(0, types.float16, alignment=16)  # weight scales
        smem_f = cuda.shared.array(0, types.float32, alignment=16)  # activation scales, partial sums
        griddep_wait()                                  # kernels/pdl.py: before any global access
        griddep_launch_dependents()
        n_rows = wq.shape[0]
        k = wq.shape[1]
        n_act = xq.shape[0]
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        g = lane >> 2
        t = lane & 3
        n_tiles_all = (n_rows + 15) // 16
        tile_id = cuda.blockIdx.x * TILES_PER_BLOCK + warp // splits
        live = tile_id < n_tiles_all                    # warps past the last tile copy it and store nothing
        tile = min(tile_id, n_tiles_all - 1)
        split = warp % splits
        n_st = k // STAGE_K
        s_lo = split * n_st // splits
        n = (split + 1) * n_st // splits - s_lo
        ring = uint32(warp * stages * SLOT)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        for i in range(stages - 1):                     # the first STAGES - 1 stages on their way
            if i < n:
                issue(smem, ring + uint32(i * SLOT), s_lo + i, wq, ws, xq, xs, tile, lane, n_rows, k, n_act)
            ptx.cp_async_commit()                       # a group per stage, empty or not: counts stay uniform
        for i in range(n):
            if stages == 2:
                ptx.cp_async_wait_all()                 # stage i has landed (this lane's copies)
            else:
                ptx.cp_async_wait_1()                   # all but the newest group: stage i has landed
            ptx.syncwarp()                              # ... every lane's; and slot (i - 1) % STAGES is free
            nxt = i + stages - 1
            if nxt < n:
                issue(smem, ring + uint32((nxt % stages) * SLOT), s_lo + nxt, wq, ws, xq, xs, tile, lane,
                      n_rows, k, n_act)
            ptx.cp_async_commit()
            compute(smem64, smem_h, smem_f, ring + uint32((i % stages) * SLOT), g, t, acc)
        if splits > 1:                                  # the tile's splits meet in shared memory
            ptx.cp_async_wait_all()
            cuda.syncthreads()                          # every ring read: the bytes become partial sums
            for i in range(NACC):
                smem_f[uint32((warp * NACC + i) * 32 + lane)] = acc[i]
            cuda.syncthreads()
            if split == 0:
                for i in range(NACC):
                    tot = float32(0.0)
                    for s in range(splits):
                        tot += smem_f[uint32(((warp + s) * NACC + i) * 32 + lane)]
                    acc[i] = tot
        if live and split == 0:
            for i in range(NACC):
                row = 16 * tile + g + 8 * ((i >> 1) & 1)
                col = 8 * (i >> 2) + 2 * t + (i & 1)
                if row < n_rows and col < n_act:
                    out[col, row] = acc[i] + out[col, row] if accumulate else acc[i]

    return gemv_rows_ring


def gemv_rows_ring_q8(wq, ws, xq, xs, out, *, accumulate=False, config=None, splits=None, stream=0):
    """out = x W^T (or out += x W^T) for 1 <= B <= 16 rows, K % 256 == 0 (shapes checked by the caller,
    q8/gemv_rows.gemv_rows_q8). config: (warps per block, stages) instead of CONFIG; splits: S instead of
    choose_splits (it must divide the warps)."""
    n_rows, k = wq.shape
    n_tiles = (xq.shape[0] + 7) // 8
    warps, stages = config or CONFIG[n_tiles]
    s = splits or choose_splits(n_rows, k, warps, stages, sm_count(), n_tiles)
    if warps % s or stages not in (2, 3) or k % STAGE_K:
        raise ValueError(f"gemv_rows_ring: {warps} warps, {stages} stages, {s} splits, K {k}")
    kernel = _ring_kernel(n_tiles, warps, stages, s)
    args = (wq, ws, xq, xs, out, 1 if accumulate else 0)
    nbytes = smem_bytes(n_tiles, warps, stages)
    allow_dynamic_smem(kernel, args, nbytes)
    tiles = -(-n_rows // 16)
    kernel[-(-tiles // (warps // s)), 32 * warps, stream, nbytes](*args)
