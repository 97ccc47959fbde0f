"""Prefill GEMM on Hopper tensor cores, W8A16: out[m, n] (+)= sum_k xh[m, k] · float16(wq[n, k] · ws[n, k/32]).

Operands: wq int8 [N, K] and ws float16 [N, K/32] (the repacked Q8_0 weights, quant_ref.py), xh float16
[M, K] activations, out float32 [M, N]. K % 32 == 0, N % 4 == 0; M and N need not fill a tile.

Why W8A16 and not int8 x int8: with Q8 scales on both operands every 32-deep int8 product must be converted
and scaled into a float accumulator (three ALU instructions per accumulator per 32 k), which caps an int8
kernel near the instruction-issue rate, not the tensor-core rate. Here the weight tile is dequantized once
per CTA into f16 shared memory (BM = 128 activation rows share each dequantized weight), and every product
is a plain ``wgmma`` m64nNk16 f16 x f16 -> f32 with no scale in the inner loop. Activations stay f16 (no
int8 activation quantization), weights are float16(q · d): 2^-11 relative rounding per weight.

CTA: 256 threads = 2 warpgroups; tile BM = 128 rows (warpgroup w owns rows 64w..64w+63) x BN = 256 or 128
columns (``_choose_bn``: fewer columns when the grid would not fill the GPU). K advances BK = 64 per stage
(one 128-byte swizzled row of f16 per tile row, ptx_sm90.py). Shared memory holds A_SLOTS = 5 activation
stages [128 rows x 128 B] and B_SLOTS = 3 dequantized weight stages [BN rows x 128 B].

Iteration kt (every thread; one barrier):
  1. barrier: A(kt) and B(kt) are in their slots and visible to the tensor cores.
  2. issue 4 wgmma k16 steps on them; commit.
  3. dequantize B(kt + 1) from registers (loaded in iteration kt - 1) into its slot (st.shared).
  4. wait for this thread's cp.async of A(kt + 1); fence.proxy.async (both writes reach the async proxy).
  5. load B(kt + 2)'s int8 and scales from global into registers (16-byte nc loads).
  6. cp.async A(kt + 3) into its slot.
  7. wgmma wait_group 1: this warpgroup's group kt - 1 is done.
Slot reuse is safe: steps 3 and 6 write the slots of stage kt - 2, which every warpgroup finished (its step 7
of iteration kt - 1) before the barrier. The fence comes before the new loads are issued, so it never waits
for memory the loop does not need yet. The tensor cores run group kt during steps 3-7, and group kt + 1 is
queued at the next barrier while group kt still runs. Activations are copied 2 iterations ahead of their use,
weights loaded 1 iteration ahead.

Rasterization: one-dimensional grid, tiles ordered in groups of GROUP_M row tiles (all column tiles of the
group, row tile fastest), so the ~132 CTAs in flight share a few activation tiles and a few weight tiles in
L2 instead of streaming the whole weight matrix once per row tile.

Epilogue: the accumulators go through shared memory (rows padded by 8 floats: conflict-free) and leave as
16-byte coalesced stores, added to ``out`` when accumulating (the residual add).

Tails: rows past M or N are loaded from a clamped valid row and never stored; a final half stage (K % 64 ==
32) has its last 32 k zeroed in both tiles (stale shared memory could hold NaN patterns).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import types, uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels import ptx_sm90 as sm90
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.quant_ref import QK

BM = 128                          # activation rows per CTA (2 warpgroups x 64)
BK = 64                           # K per stage: 64 f16 = one 128-byte swizzled row
A_SLOTS = 5                       # activation stages in shared memory (copied 3 stages ahead)
B_SLOTS = 3                       # dequantized weight stages (written 1 stage ahead)
TPB = 256
GROUP_M = 8                       # row tiles per rasterization group
ROW_BYTES = sm90.SWIZZLE_ROW_BYTES
A_STAGE = BM * ROW_BYTES          # 16 KiB of activations per stage
STATIC_SMEM_LIMIT = 48 * 1024
_OCCUPANCY = {} if SIMULATOR else {"launch_bounds": (TPB, 1)}   # one CTA per SM: up to 255 registers


def smem_bytes(bn: int) -> int:
    """Dynamic shared memory of one CTA: the pipeline slots or the epilogue tile, plus 1 KiB so the
    swizzled tiles can start on a 1024-byte boundary."""
    pipeline = A_SLOTS * A_STAGE + B_SLOTS * bn * ROW_BYTES
    epilogue = BM * (bn + 8) * 4
    return max(pipeline, epilogue) + 1024


@lru_cache(maxsize=None)
def _kernel(bn: int, fence: bool = True, w_depth: int = 1):
    b_chunks = bn * BK // 16 // TPB          # 16-byte int8 weight chunks per thread per stage: 4 or 2
    b_words = 4 * b_chunks
    b_stage = bn * ROW_BYTES
    b_base = A_SLOTS * A_STAGE               # B slots follow the A slots
    epi_row = (bn + 8) * 4                   # bytes per epilogue row
    per_row = bn // 4                        # float4 per epilogue row
    wgmma = sm90.wgmma_f16(bn)
    zero = sm90.acc_zero(bn)
    store_acc = sm90.acc_store(bn)

    # Thread roles, fixed for the whole K loop (offsets kept in registers, advanced by kt only):
    #   A copy: 16-byte chunk c = tid & 7 (k 8c..8c+7) of tile rows (tid >> 3) + 32 i, i < 4
    #   B dequant: int8 chunk p = tid & 3 (k 16p..16p+15) of weight rows (tid >> 2) + 64 i, i < b_chunks;
    #              it becomes the f16 chunks 2p and 2p + 1 of the row
    @cuda.jit(device=True, inline=True)
    def issue_a(smem, xh, a_src, a_dst, kt, k):
        """cp.async stage kt of the activation tile into its slot; chunks past K are zeroed instead."""
        kofs = uint32(kt * BK)
        at = a_dst + uint32((uint32(kt) % uint32(A_SLOTS)) * A_STAGE)
        if kofs + uint32((cuda.threadIdx.x & 7) * 8) < uint32(k):
            for i in range(4):
                sm90.cp_async_16b(smem, at + uint32(4096 * i), xh, a_src[i] + kofs)
        else:
            for i in range(4):
                sm90.st_shared_v4(smem, at + uint32(4096 * i), 0, 0, 0, 0)

    @cuda.jit(device=True, inline=True)
    def load_b(wq, ws_flat, b_src, s_src, kt, k, r_w, r_s):
        """Registers <- this thread's int8 weight chunks of stage kt and their f16 scale bits."""
        kofs = uint32(kt * BK)
        if kofs + uint32((cuda.threadIdx.x & 3) * 16) < uint32(k):
            for i in range(b_chunks):
                w = ptx.ldg_nc_v4_u32(wq, b_src[i] + kofs)
                for e in range(4):
                    r_w[4 * i + e] = w[e]
                r_s[i] = uint32(ws_flat[s_src[i] + uint32(kt * 2)])

    @cuda.jit(device=True, inline=True)
    def store_b(smem, b_dst0, b_dst1, kt, k, r_w, r_s):
        """Dequantize the registers of stage kt into its B slot; chunks past K are zeroed instead."""
        slot = uint32((uint32(kt) % uint32(B_SLOTS)) * b_stage)
        if uint32(kt * BK) + uint32((cuda.threadIdx.x & 3) * 16) < uint32(k):
            for i in range(b_chunks):
                s2 = r_s[i] | (r_s[i] << uint32(16))
                l0, h0 = sm90.dequant_i8x4(r_w[4 * i], s2)
                l1, h1 = sm90.dequant_i8x4(r_w[4 * i + 1], s2)
                sm90.st_shared_v4(smem, b_dst0 + slot + uint32(8192 * i), l0, h0, l1, h1)
                l0, h0 = sm90.dequant_i8x4(r_w[4 * i + 2], s2)
                l1, h1 = sm90.dequant_i8x4(r_w[4 * i + 3], s2)
                sm90.st_shared_v4(smem, b_dst1 + slot + uint32(8192 * i), l0, h0, l1, h1)
        else:
            for i in range(b_chunks):
                sm90.st_shared_v4(smem, b_dst0 + slot + uint32(8192 * i), 0, 0, 0, 0)
                sm90.st_shared_v4(smem, b_dst1 + slot + uint32(8192 * i), 0, 0, 0, 0)

    @cached_jit(**_OCCUPANCY)
    def kernel(wq, ws_flat, xh, out, accumulate):
        """wq: [N, K] int8, ws_flat: [N * K/32] uint16 (f16 bits of ws [N, K/32]), xh: [M, K] f16,
        out: [M, N] f32; grid (ceil(M / BM) * ceil(N / bn),), block (TPB,), dynamic shared smem_bytes(bn)."""
        smem = cuda.shared.array(0, types.uint32, alignment=16)     # [A_SLOTS][128 x 128 B] | [B_SLOTS][bn x 128 B]
        r_w = cuda.local.array(b_words, np.uint32)               # [b_chunks x 4] int8 words of the next stage
        r_s = cuda.local.array(b_chunks, np.uint32)              # [b_chunks] their f16 scale bits
        r_w1 = cuda.local.array(b_words, np.uint32)              # w_depth 2: the stage after (odd stages)
        r_s1 = cuda.local.array(b_chunks, np.uint32)
        a_src = cuda.local.array(4, np.uint32)                   # [4] xh element offsets of my A chunks at k 0
        b_src = cuda.local.array(b_chunks, np.uint32)            # [b_chunks] wq byte offsets of my B chunks
        s_src = cuda.local.array(b_chunks, np.uint32)            # [b_chunks] ws_flat offsets of their scales
        m_rows, k = xh.shape
        n_rows = wq.shape[0]
        tid = cuda.threadIdx.x
        # rasterization: groups of GROUP_M row tiles, row tile fastest inside a group
        tiles_m = (m_rows + BM - 1) // BM
        tiles_n = (n_rows + bn - 1) // bn
        pid = cuda.blockIdx.x
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        m0 = (first_m + (pid % per_group) % group_rows) * BM
        n0 = ((pid % per_group) // group_rows) * bn
        pad = (uint32(1024) - (sm90.smem_u32(smem) & uint32(1023))) & uint32(1023)

        for i in range(4):                                       # rows past M read the last row
            a_src[i] = uint32(min(m0 + (tid >> 3) + 32 * i, m_rows - 1) * k + (tid & 7) * 8)
        for i in range(b_chunks):                                # rows past N read the last row
            row = min(n0 + (tid >> 2) + 64 * i, n_rows - 1)
            b_src[i] = uint32(row * k + (tid & 3) * 16)
            s_src[i] = uint32(row * (k // QK) + ((tid & 3) >> 1))
        a_dst = pad + uint32((tid >> 3) * ROW_BYTES + (((tid & 7) ^ ((tid >> 3) & 7)) << 4))
        swz = (tid >> 2) & 7
        b_row = pad + uint32(b_base + (tid >> 2) * ROW_BYTES)
        b_dst0 = b_row + uint32(((2 * (tid & 3)) ^ swz) << 4)
        b_dst1 = b_row + uint32(((2 * (tid & 3) + 1) ^ swz) << 4)
        n_k = (k + BK - 1) // BK

        issue_a(smem, xh, a_src, a_dst, 0, k)
        ptx.cp_async_commit()
        load_b(wq, ws_flat, b_src, s_src, 0, k, r_w, r_s)
        store_b(smem, b_dst0, b_dst1, 0, k, r_w, r_s)
        ptx.cp_async_wait_all()
        sm90.fence_proxy_async()
        for kt in range(1, 3):
            if kt < n_k:
                issue_a(smem, xh, a_src, a_dst, kt, k)
            ptx.cp_async_commit()
        if w_depth == 1:
            if n_k > 1:
                load_b(wq, ws_flat, b_src, s_src, 1, k, r_w, r_s)
        else:
            if n_k > 1:
                load_b(wq, ws_flat, b_src, s_src, 1, k, r_w1, r_s1)
            if n_k > 2:
                load_b(wq, ws_flat, b_src, s_src, 2, k, r_w, r_s)
        acc = zero()
        a_off = pad + uint32((tid >> 7) * 64 * ROW_BYTES)       # this warpgroup's 64 rows of A
        for kt in range(n_k):
            cuda.syncthreads()
            a_byte = a_off + uint32((uint32(kt) % uint32(A_SLOTS)) * A_STAGE)
            b_byte = pad + uint32(b_base + (uint32(kt) % uint32(B_SLOTS)) * b_stage)
            sm90.wgmma_fence()
            acc = wgmma(acc, smem, a_byte, b_byte)
            acc = wgmma(acc, smem, a_byte + uint32(32), b_byte + uint32(32))
            acc = wgmma(acc, smem, a_byte + uint32(64), b_byte + uint32(64))
            acc = wgmma(acc, smem, a_byte + uint32(96), b_byte + uint32(96))
            sm90.wgmma_commit()
            if w_depth == 1:
                if kt + 1 < n_k:
                    store_b(smem, b_dst0, b_dst1, kt + 1, k, r_w, r_s)
            elif kt & 1:
                if kt + 1 < n_k:
                    store_b(smem, b_dst0, b_dst1, kt + 1, k, r_w, r_s)
            else:
                if kt + 1 < n_k:
                    store_b(smem, b_dst0, b_dst1, kt + 1, k, r_w1, r_s1)
            ptx.cp_async_wait_1()                                # A(kt + 1) has landed
            if fence:
                sm90.fence_proxy_async()                         # ... and this thread's st.shared are visible
            if w_depth == 1:
                if kt + 2 < n_k:
                    load_b(wq, ws_flat, b_src, s_src, kt + 2, k, r_w, r_s)
            elif kt & 1:
                if kt + 3 < n_k:
                    load_b(wq, ws_flat, b_src, s_src, kt + 3, k, r_w, r_s)
            else:
                if kt + 3 < n_k:
                    load_b(wq, ws_flat, b_src, s_src, kt + 3, k, r_w1, r_s1)
            if kt + 3 < n_k:
                issue_a(smem, xh, a_src, a_dst, kt + 3, k)
            ptx.cp_async_commit()
            sm90.wgmma_wait_1()
        sm90.wgmma_wait_0()
        cuda.syncthreads()                                       # every wgmma has read its tiles

        lane = tid & 31
        row = (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + (lane >> 2)
        store_acc(acc, smem, pad + uint32(row * epi_row + (lane & 3) * 8), uint32(epi_row))
        cuda.syncthreads()
        for it in range(BM * per_row // TPB):
            e = tid + TPB * it
            r = e // per_row
            c4 = e % per_row
            m = m0 + r
            n = n0 + 4 * c4
            if m < m_rows and n < n_rows:
                v0, v1, v2, v3 = sm90.ld_shared_v4_f32(smem, pad + uint32(r * epi_row + c4 * 16))
                if accumulate:
                    v0 += out[m, n]
                    v1 += out[m, n + 1]
                    v2 += out[m, n + 2]
                    v3 += out[m, n + 3]
                sm90.st_global_v4_f32(out, m * n_rows + n, v0, v1, v2, v3)

    return kernel


def _choose_bn(m: int, n: int, n_sm: int) -> int:
    """BN = 256 unless 128 gives fewer (weighted) waves: a 128-column tile moves 1.2x the shared-memory
    bytes per multiply-add, so it wins only where 256 leaves SMs idle (small M or N)."""
    def cost(bn):
        tiles = -(-m // BM) * -(-n // bn)
        return -(-tiles // n_sm) * bn * (1.0 if bn == 256 else 1.2)
    return min((256, 128), key=cost)


_OPTED_IN: set = set()


def _allow_dynamic_smem(kernel, args, nbytes: int) -> None:
    """Raise the kernel's dynamic shared-memory limit above 48 KiB (numba-cuda has no automatic opt-in)."""
    from numba.cuda.cudadrv.driver import binding, driver
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    key = (kernel, argtypes, cuda.get_current_device().id)
    if key in _OPTED_IN:
        return
    cufunc = kernel.compile(argtypes).library.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    _OPTED_IN.add(key)


def _sm_count() -> int:
    return 132 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


def gemm_w8a16(wq, ws, xh, out, *, accumulate: bool = False, bn: int | None = None, stream=0,
               variant: tuple = ()) -> None:
    """out (+)= xh · float16(wq · ws)ᵀ on sm_90 tensor cores.

    wq: [N, K] int8, ws: [N, K/32] float16, xh: [M, K] float16, out: [M, N] float32 (written, or added to
    with accumulate=True). K % 32 == 0 and N % 4 == 0. ``bn`` forces the tile width (256 or 128)."""
    m, k = xh.shape
    n = wq.shape[0]
    if wq.shape[1] != k or k % QK or tuple(ws.shape) != (n, k // QK) or tuple(out.shape) != (m, n) or n % 4:
        raise ValueError(f"gemm_w8a16 shapes: wq {tuple(wq.shape)}, ws {tuple(ws.shape)}, xh {tuple(xh.shape)}, "
                         f"out {tuple(out.shape)} (need K % 32 == 0, N % 4 == 0)")
    if m == 0:
        return
    bn = bn or _choose_bn(m, n, _sm_count())
    if bn not in (128, 256):
        raise ValueError(f"bn must be 128 or 256, not {bn}")
    kernel = _kernel(bn, *variant)
    args = (wq, ws.view(np.uint16).reshape(-1), xh, out, 1 if accumulate else 0)
    nbytes = smem_bytes(bn)
    if not SIMULATOR and nbytes > STATIC_SMEM_LIMIT:
        _allow_dynamic_smem(kernel, args, nbytes)
    grid = -(-m // BM) * -(-n // bn)
    kernel[grid, TPB, stream, nbytes](*args)
