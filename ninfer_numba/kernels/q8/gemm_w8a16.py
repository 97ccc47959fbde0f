"""Prefill GEMM on Hopper tensor cores, W8A16: out[m, n] (+)= sum_k xh[m, k] · float16(wq[n, k] · ws[n, k/32]).

Operands: wq int8 [N, K] and ws float16 [N, K/32] (the repacked Q8_0 weights, q8/ref.py), xh float16
[M, K] activations in fragment order (q8.ref.to_fragment_order: columns permuted inside each 32-block;
the f16 activation kernels of act_f16.py write it), out float32 [M, N]. K % 32 == 0, N % 4 == 0.

Why W8A16, and why the weights are the register operand: with Q8 scales on both sides, an int8 kernel must
convert and scale every 32-deep partial product into a float accumulator (three ALU instructions per
accumulator per 32 k), which caps it at the instruction-issue rate. Here each weight is dequantized once per
CTA, exactly, to float16(q · d) and every product is a plain ``wgmma`` m64nNk16 f16 x f16 -> f32. The weights
are wgmma's A operand, taken from registers: each thread loads the int8 bytes of its own fragment (two
8-byte loads per row and 32-block, contiguous thanks to the fragment order of the activations), converts them
in registers and hands them to the tensor cores. So dequantized weights never touch shared memory (the first
version of this kernel stored them there: shared-memory traffic, not the tensor cores, limited it to ~410
TOPS; benchmarks/NOTES.md), and shared memory carries only the activation tiles.

CTA: 256 threads = 2 warpgroups. Tile: BW = 128 weight rows (output columns; warpgroup j owns rows
64j..64j+63, thread (warp w, lane 4g + q) rows 16w + g and 16w + g + 8) x BA = 256, 192, 128, 64 or 32
activation rows (output rows, the wgmma N). K advances BK = 64 per stage: 4 wgmma k16 steps. gemm_plan.py
picks BA and a split of K by waves of CTAs: smaller tiles and K split into parts where one CTA per output
tile would leave SMs idle (a short prompt's forward); split z's products go to a workspace and _sum_splits
adds them in split order. Shared memory: A_SLOTS = 5 activation stages [BA rows x 128 B] (128-byte swizzle,
ptx_sm90.py), filled by cp.async 3 stages ahead; the same bytes hold the epilogue tile at the end.
Registers: the accumulators (BA/2 float32), two sets of A fragments (16 uint32 each: the stage being
multiplied and the next), two sets of int8 weight words (8 uint32 + 4 scales: the next two stages).

Iteration kt (every thread; one barrier):
  1. barrier: activations of stage kt are in their slot, visible to the tensor cores.
  2. 4 wgmma on fragments F(kt) and that slot; commit.
  3. dequantize the int8 words of stage kt + 1 (loaded two iterations ago) into F(kt + 1).
  4. wait for this thread's cp.async of stage kt + 1; fence.proxy.async.
  5. load stage kt + 3's int8 words and scales (nc loads) into the set step 3 freed.
  6. cp.async stage kt + 3's activations into the slot of stage kt - 2.
  7. wgmma wait_group 1: group kt - 1 (which read F(kt - 1), the set step 3 of iteration kt + 1 rewrites,
     and the slot step 6 of iteration kt + 1 rewrites) is done.
Slot reuse is safe: the slot of step 6 was last read by group kt - 2, which both warpgroups finished (their
step 7 of iteration kt - 1) before this iteration's barrier. The loop is unrolled by two so that both
register sets have compile-time names.

Rasterization: a one-dimensional grid in groups of GROUP_M activation tiles (all weight tiles of a group,
activation tile fastest), so the ~132 CTAs in flight share a few tiles of each operand in L2.

Epilogue: the accumulators go through shared memory transposed (rows of 128 + 4 floats: conflict-free) and
leave as 16-byte coalesced stores, added to ``out`` when accumulating (the residual add).

Tails: weight rows past N are loaded from a clamped valid row and never stored; activation rows past M are
not loaded at all (their slot rows keep stale bytes, which reach only output rows never stored); a final
half stage (K % 64 == 32) has its second 32-block zeroed in both operands (stale shared memory could hold
NaN patterns, and those rows are stored).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import types, uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels import ptx_sm90 as sm90
from ninfer_numba.kernels.dynamic_smem import allow_dynamic_smem
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, sm_count
from ninfer_numba.kernels.q8.gemm_plan import BK, BW, STAGE_COST, plan
from ninfer_numba.kernels.q8.ref import QK

A_SLOTS = 5                       # activation stages in shared memory (copied 3 stages ahead)
TPB = 256
GROUP_M = 8                       # activation tiles per rasterization group
ROW_BYTES = sm90.SWIZZLE_ROW_BYTES
EPI_ROW = (BW + 4) * 4            # epilogue tile row: 128 floats + 4 (bank shift 4 per row: conflict-free)
_OCCUPANCY = {} if SIMULATOR else {"launch_bounds": (TPB, 1)}   # one CTA per SM: up to 255 registers


def smem_bytes(ba: int) -> int:
    """Dynamic shared memory of one CTA: the activation slots or the epilogue tile, plus 1 KiB so the
    swizzled tiles can start on a 1024-byte boundary."""
    return max(A_SLOTS * ba * ROW_BYTES, ba * EPI_ROW) + 1024


@lru_cache(maxsize=None)
def _kernel(ba: int):
    slot_bytes = ba * ROW_BYTES
    a_chunks = ba * 8 // TPB                 # 16-byte activation chunks per thread per stage: 8, 6 or 4
    per_row = BW // 4                        # float4 per epilogue row
    wgmma = sm90.wgmma_rs_f16(ba)
    zero = sm90.acc_zero(ba)
    store_acc = sm90.acc_store_t(ba)

    @cuda.jit(device=True, inline=True)
    def issue_a(smem, xh, a_src, a_dst, kt, k, rows_left):
        """cp.async stage kt of the activation tile (chunk tid & 7 of rows (tid >> 3) + 32 i) into its slot;
        chunks past K are zeroed instead. Rows past M (i with 32 i >= rows_left) are not copied at all: their
        stale bytes reach only output rows that are never stored, and copying a clamped row there made every
        thread of a short tile read the same 16 bytes, which the load path serializes (a 2-row forward's
        GEMMs took 1.8x a 128-row one's)."""
        kofs = uint32(kt * BK)
        at = a_dst + uint32((uint32(kt) % uint32(A_SLOTS)) * slot_bytes)
        if kofs + uint32((cuda.threadIdx.x & 7) * 8) < uint32(k):
            for i in range(a_chunks):
                if 32 * i < rows_left:
                    sm90.cp_async_16b(smem, at + uint32(4096 * i), xh, a_src[i] + kofs)
        else:
            for i in range(a_chunks):
                if 32 * i < rows_left:
                    sm90.st_shared_v4(smem, at + uint32(4096 * i), 0, 0, 0, 0)

    @cuda.jit(device=True, inline=True)
    def load_w(wq, ws_flat, w_src, s_src, kt, k, r_w, r_s):
        """r_w[4 row + 2 block + i] <- this thread's int8 words of stage kt (8 bytes at 8q of each 32-block of
        rows 16w + g and + 8), r_s[2 row + block] <- their scales' f16 bits; blocks past K read as zero."""
        for b in range(2):
            if uint32(kt * BK + b * QK) < uint32(k):
                for row in range(2):
                    w = ptx.ldg_nc_v2_u32(wq, w_src[row] + uint32(kt * BK + b * QK))
                    r_w[4 * row + 2 * b] = w[0]
                    r_w[4 * row + 2 * b + 1] = w[1]
                    r_s[2 * row + b] = uint32(ws_flat[s_src[row] + uint32(kt * 2 + b)])
            else:
                for row in range(2):
                    r_w[4 * row + 2 * b] = 0
                    r_w[4 * row + 2 * b + 1] = 0
                    r_s[2 * row + b] = 0

    @cuda.jit(device=True, inline=True)
    def dequant(r_w, r_s, frag):
        """frag[4 step + reg] <- the A fragments of one stage: step 2b + i takes word i of block b; the low
        f16 pair of row 16w + g is a0, of row + 8 a1, the high pairs a2, a3."""
        for b in range(2):
            s0 = r_s[b] | (r_s[b] << uint32(16))
            s1 = r_s[2 + b] | (r_s[2 + b] << uint32(16))
            for i in range(2):
                lo0, hi0 = sm90.dequant_i8x4(r_w[2 * b + i], s0)
                lo1, hi1 = sm90.dequant_i8x4(r_w[4 + 2 * b + i], s1)
                step = 2 * b + i
                frag[4 * step] = lo0
                frag[4 * step + 1] = lo1
                frag[4 * step + 2] = hi0
                frag[4 * step + 3] = hi1

    @cuda.jit(device=True, inline=True)
    def iteration(acc, smem, wq, ws_flat, xh, kt, n_k, k, rows_left, a_byte, a_src, a_dst, w_src, s_src,
                  f_cur, f_next, r_w, r_s):
        """Steps 1-7 of the module docstring for stage kt: multiply F(kt) = f_cur, dequantize r_w (stage
        kt + 1) into f_next, then refill r_w with stage kt + 3."""
        cuda.syncthreads()
        slot = a_byte + uint32((uint32(kt) % uint32(A_SLOTS)) * slot_bytes)
        sm90.wgmma_fence()
        for step in range(4):
            acc = wgmma(acc, f_cur[4 * step], f_cur[4 * step + 1], f_cur[4 * step + 2], f_cur[4 * step + 3],
                        smem, slot + uint32(32 * step))
        sm90.wgmma_commit()
        if kt + 1 < n_k:
            dequant(r_w, r_s, f_next)
        ptx.cp_async_wait_1()                                    # stage kt + 1's activations have landed
        sm90.fence_proxy_async()
        if kt + 3 < n_k:
            load_w(wq, ws_flat, w_src, s_src, kt + 3, k, r_w, r_s)
            issue_a(smem, xh, a_src, a_dst, kt + 3, k, rows_left)
        ptx.cp_async_commit()
        sm90.wgmma_wait_1()
        return acc

    @cached_jit(**_OCCUPANCY)
    def kernel(wq, ws_flat, xh, out, part, accumulate, per_split):
        """wq: [N, K] int8, ws_flat: [N * K/32] uint16 (f16 bits of ws [N, K/32]), xh: [M, K] f16 in fragment
        order, out: [M, N] f32, part: [splits * M * N] f32 (split z's products at z * M * N; unused with one
        split); grid (ceil(M / ba) * ceil(N / BW), splits), block (TPB,), dynamic shared smem_bytes(ba).
        Split z multiplies K stages [z * per_split, (z + 1) * per_split): its operands' offsets start there
        and the loop sees only that slice of K."""
        smem = cuda.shared.array(0, types.uint32, alignment=16)  # [A_SLOTS][ba x 128 B]; epilogue [ba][132] f32
        f0 = cuda.local.array(16, np.uint32)                     # [4 steps x a0..a3] A fragments, even stages
        f1 = cuda.local.array(16, np.uint32)                     # odd stages
        w0 = cuda.local.array(8, np.uint32)                      # [2 rows x 2 blocks x 2 words] int8, even
        w1 = cuda.local.array(8, np.uint32)                      # odd stages
        s0 = cuda.local.array(4, np.uint32)                      # [2 rows x 2 blocks] f16 scale bits, even
        s1 = cuda.local.array(4, np.uint32)                      # odd stages
        a_src = cuda.local.array(a_chunks, np.uint32)            # [a_chunks] xh offsets of my chunks at k0
        w_src = cuda.local.array(2, np.uint32)                   # [2 rows] wq offsets of my bytes at k0
        s_src = cuda.local.array(2, np.uint32)                   # [2 rows] ws_flat offsets of their scales
        m_rows, k_all = xh.shape
        n_rows = wq.shape[0]
        tid = cuda.threadIdx.x
        tiles_m = (m_rows + ba - 1) // ba
        tiles_n = (n_rows + BW - 1) // BW
        pid = cuda.blockIdx.x
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        m0 = (first_m + (pid % per_group) % group_rows) * ba
        n0 = ((pid % per_group) // group_rows) * BW
        split = cuda.blockIdx.y
        k0 = split * per_split * BK                              # this split's first K column
        k = min(k_all - k0, per_split * BK)                      # and how many it multiplies
        pad = (uint32(1024) - (sm90.smem_u32(smem) & uint32(1023))) & uint32(1023)

        rows_left = m_rows - m0 - (tid >> 3)                     # my activation chunks' rows below M: 32 i < this
        for i in range(a_chunks):                                # (rows past M keep a clamped, unused offset)
            a_src[i] = uint32(min(m0 + (tid >> 3) + 32 * i, m_rows - 1) * k_all + (tid & 7) * 8 + k0)
        wrow = (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2)
        for row in range(2):                                     # weight rows past N read the last row
            src = min(n0 + wrow + 8 * row, n_rows - 1)
            w_src[row] = uint32(src * k_all + (tid & 3) * 8 + k0)
            s_src[row] = uint32(src * (k_all // QK) + k0 // QK)
        a_dst = pad + uint32((tid >> 3) * ROW_BYTES + (((tid & 7) ^ ((tid >> 3) & 7)) << 4))
        n_k = (k + BK - 1) // BK

        load_w(wq, ws_flat, w_src, s_src, 0, k, w0, s0)
        dequant(w0, s0, f0)
        for kt in range(3):
            if kt < n_k:
                issue_a(smem, xh, a_src, a_dst, kt, k, rows_left)
            ptx.cp_async_commit()
        if n_k > 1:
            load_w(wq, ws_flat, w_src, s_src, 1, k, w1, s1)
        if n_k > 2:
            load_w(wq, ws_flat, w_src, s_src, 2, k, w0, s0)
        ptx.cp_async_wait_1()                                    # stages 0 and 1 have landed (2 may not)
        sm90.fence_proxy_async()
        acc = zero()
        for kt in range(0, n_k, 2):
            acc = iteration(acc, smem, wq, ws_flat, xh, kt, n_k, k, rows_left, pad, a_src, a_dst, w_src,
                            s_src, f0, f1, w1, s1)
            if kt + 1 < n_k:
                acc = iteration(acc, smem, wq, ws_flat, xh, kt + 1, n_k, k, rows_left, pad, a_src, a_dst,
                                w_src, s_src, f1, f0, w0, s0)
        sm90.wgmma_wait_0()
        cuda.syncthreads()                                       # every wgmma has read its tiles

        lane = tid & 31
        store_acc(acc, smem, pad + uint32((lane & 3) * 2 * EPI_ROW + wrow * 4), uint32(EPI_ROW))
        cuda.syncthreads()
        splits = cuda.gridDim.y
        for it in range(ba * per_row // TPB):
            e = tid + TPB * it
            r = e // per_row
            c4 = e % per_row
            m = m0 + r
            n = n0 + 4 * c4
            if m < m_rows and n < n_rows:
                v0, v1, v2, v3 = sm90.ld_shared_v4_f32(smem, pad + uint32(r * EPI_ROW + c4 * 16))
                if splits > 1:                                   # _sum_splits adds the parts (and out)
                    sm90.st_global_v4_f32(part, (split * m_rows + m) * n_rows + n, v0, v1, v2, v3)
                else:
                    if accumulate:
                        v0 += out[m, n]
                        v1 += out[m, n + 1]
                        v2 += out[m, n + 2]
                        v3 += out[m, n + 3]
                    sm90.st_global_v4_f32(out, m * n_rows + n, v0, v1, v2, v3)

    return kernel


@cached_jit()
def _sum_splits(part, out, splits, accumulate):
    """out[m, n] (+)= part[0, m, n] + part[1, m, n] + ... in split order (the same sum on every run).
    part: [splits * M * N] f32, out: [M, N] f32; grid (ceil(M * N / 256),), block (256,)."""
    i = cuda.grid(1)
    m_rows, n_rows = out.shape
    if i < m_rows * n_rows:
        m = i // n_rows
        n = i - m * n_rows
        acc = out[m, n] if accumulate else np.float32(0.0)
        for z in range(splits):
            acc += part[z * m_rows * n_rows + i]
        out[m, n] = acc


_WS_BITS: dict = {}                    # id(ws) -> (ws, its flat uint16 view): one view per weight matrix


def _scale_bits(ws):
    """ws [N, K/32] float16 as flat uint16 words, the view made once per array (a prefill forward launches
    ~130 GEMMs; building device-array views costs host time on each)."""
    hit = _WS_BITS.get(id(ws))
    if hit is None or hit[0] is not ws:
        hit = _WS_BITS[id(ws)] = (ws, ws.view(np.uint16).reshape(-1))
    return hit[1]


def gemm_w8a16(wq, ws, xh, out, *, accumulate: bool = False, ba: int | None = None, splits: int | None = None,
               split_ws=None, stream=0) -> None:
    """out (+)= xh · float16(wq · ws)ᵀ on sm_90 tensor cores.

    wq: [N, K] int8, ws: [N, K/32] float16, xh: [M, K] float16 in fragment order
    (q8.ref.to_fragment_order), out: [M, N] float32 (written, or added to with accumulate=True).
    K % 32 == 0 and N % 4 == 0. split_ws: float32 [>= split_ws_floats(SMs)] device workspace; with it a grid
    that would leave SMs idle splits K (plan()), without it K is never split. ``ba`` forces the activation
    tile (one of STAGE_COST), ``splits`` the number of K splits (more than one needs split_ws)."""
    m, k = xh.shape
    n = wq.shape[0]
    if wq.shape[1] != k or k % QK or tuple(ws.shape) != (n, k // QK) or tuple(out.shape) != (m, n) or n % 4:
        raise ValueError(f"gemm_w8a16 shapes: wq {tuple(wq.shape)}, ws {tuple(ws.shape)}, xh {tuple(xh.shape)}, "
                         f"out {tuple(out.shape)} (need K % 32 == 0, N % 4 == 0)")
    if ba is not None and ba not in STAGE_COST:
        raise ValueError(f"ba must be one of {sorted(STAGE_COST)}, not {ba}")
    if m == 0:
        return
    room = 0 if split_ws is None else split_ws.shape[0] // (m * n)
    if splits is not None and splits > max(room, 1):
        raise ValueError(f"{splits} K splits of a [{m}, {n}] output need a split_ws of {splits * m * n} floats"
                         f" (have {0 if split_ws is None else split_ws.shape[0]})")
    ba, planned = plan(m, n, k, sm_count(), max(room, 1), ba)
    n_k = -(-k // BK)
    per_split = -(-n_k // (splits or planned))
    splits = -(-n_k // per_split)                    # no empty split
    kernel = _kernel(ba)
    part = out.reshape(-1) if split_ws is None else split_ws    # unused with one split
    args = (wq, _scale_bits(ws), xh, out, part, 1 if accumulate else 0, per_split)
    nbytes = smem_bytes(ba)
    allow_dynamic_smem(kernel, args, nbytes)
    kernel[(-(-m // ba) * -(-n // BW), splits), TPB, stream, nbytes](*args)
    if splits > 1:
        _sum_splits[-(-m * n // 256), 256, stream](split_ws, out, splits, 1 if accumulate else 0)
