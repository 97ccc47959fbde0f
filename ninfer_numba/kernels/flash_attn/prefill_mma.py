"""Causal GQA prefill attention on fp16 tensor cores (``mma.sync.m16n8k16``, f32 accumulate), sm_80+.

Same contract as prefill.py's ``attention_prefill``: T queries at cache positions pos0..pos0+T-1 attend to
cache rows [0, pos0+T) of KV head h // (H/Hkv), scale 1/√d, output o ⊙ σ(gate). FlashAttention-2 order:

Block (query tile of BQ = 16·n_warps rows, head h); n_warps = 4 by default (64 rows, two blocks per SM)
or 8 (128 rows, one block per SM, half the K/V tile traffic per query). Warp w owns query rows
16w..16w+15 of the tile.
Per key tile of BK = 64 keys (kt0 = 0, 64, ... up to the tile's last query position):

    S  = Q Kᵀ            [16, 64] per warp: D/16 k-steps × 8 mma (Q and K fragments by ldmatrix)
    x  = S · log2(e)/√d, masked to −inf above the diagonal (only in tiles that cross it)
    m' = max(m, rowmax x);  P = 2^(x − m');  l = l·2^(m−m') + rowsum P;  O = O·2^(m−m')
    O += P V             [16, D] per warp: P (f32 accumulators → f16) is reused in registers as the A
                         operand (the C layout of two n8 tiles is the A layout of one k16 step); V
                         fragments by ldmatrix.trans
and finally out[t, h·d + i] = O/l · σ(gate).

Shared memory (dynamic, uint32 words, every row padded by 8 f16 so that the 8 rows of one ldmatrix
phase start in 8 different 4-bank groups; rows stay 16-byte aligned for cp.async and ldmatrix):

    Q [BQ rows, D/2 + 4 words]  f16 pairs, converted once from q (float32 or float16)
    K [BK rows, D/2 + 4 words]  one buffer, filled by 16-byte cp.async from the f16 cache
    V [BK rows, D/2 + 4 words]  one buffer

Pipeline per tile: wait K(i) + barrier → issue V(i) → S, softmax → wait V(i) + barrier → issue K(i+1) →
O += P V(i). The V copy overlaps Q Kᵀ and the K copy overlaps P V; two blocks per SM hide the rest.
Cache rows at or past pos0 + min(qt0 + BQ, T) are never read (the test fills them with NaN): those tile
rows are zero-filled instead, so 0 · P stays 0 in P V.

Causal mask, fragment row r of warp w, key column j of tile kt0 (cache positions):
key kt0 + j visible iff kt0 + j ≤ pos0 + qt0 + 16w + r. Key 0 is visible to every row and sits in the
first tile, so the running max is finite from then on and 2^(−inf − m) = 0 for masked keys.

Precision: Q (when given as float32) and P are rounded to f16 (unit roundoff 2^-11); products are exact
and accumulate in float32; K and V are the f16 cache values themselves.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import types

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.flash_attn.mma_f16 import mma_into, pack_f16x2
from ninfer_numba.kernels.ptx import ldmatrix_x4, ldmatrix_x4_trans
from ninfer_numba.kernels.dynamic_smem import allow_dynamic_smem
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

N_WARPS = 4                  # warps per block; each owns one m16 tile of query rows
BK = 64                      # keys per tile: 8 n8 tiles of S, 4 k16 steps of P V
MAX_D = 256                  # O is D/2 float32 registers per lane: 128 at D = 256
NEG_INF = np.float32(-np.inf)
LOG2E = 1.4426950408889634


def row_words(D: int) -> int:
    """uint32 words per shared row: D f16 + 8 f16 of padding."""
    return D // 2 + 4


def smem_bytes(D: int, n_warps: int = N_WARPS) -> int:
    """Dynamic shared memory of one block: the Q [16·n_warps rows], K and V [BK rows] tiles."""
    return (16 * n_warps + 2 * BK) * row_words(D) * 4


def supports_shape(H: int, Hkv: int, D: int) -> bool:
    """True when this kernel handles the head configuration (d a multiple of 16 up to 256, H % Hkv == 0)."""
    return 16 <= D <= MAX_D and D % 16 == 0 and Hkv > 0 and H % Hkv == 0


def launch_grid(T: int, H: int, n_warps: int = N_WARPS) -> tuple[int, int]:
    """(query tiles of 16·n_warps rows, heads)."""
    bq = 16 * n_warps
    return ((T + bq - 1) // bq, H)


class TileShape:
    """The block's tile constants, for the hooks that fill its K / V tiles and write its output."""

    def __init__(self, D: int, n_warps: int) -> None:
        self.D, self.n_warps = D, n_warps
        self.BQ = 16 * n_warps       # query rows per block
        self.TPB = 32 * n_warps
        self.RW = row_words(D)
        self.OW = D + 4              # float32 row stride of the O staging tile (reuses the Q/K/V space)


@cuda.jit(device=True, inline=True)
def zero_words(smem, dst):
    """A tile row's 16-byte chunk (4 words) zero-filled: a row past the keys needed."""
    smem[dst] = np.uint32(0)
    smem[dst + 1] = np.uint32(0)
    smem[dst + 2] = np.uint32(0)
    smem[dst + 3] = np.uint32(0)


def gated_finish(ts: TileShape, prepare, column_scale):
    """The epilogue hook: prepare(smem_f, v_cache, tid) on the staged O/l rows [BQ, OW] (a barrier after it
    if it writes them), then out rows of the tile = staged · column_scale(v_cache, c) ⊙ σ(gate), coalesced."""
    D, TPB, OW, BQ = ts.D, ts.TPB, ts.OW, ts.BQ

    @cuda.jit(device=True, inline=True)
    def finish(smem_f, qt0, T, h, proj, out, v_cache):
        tid = cuda.threadIdx.x
        prepare(smem_f, v_cache, tid)
        for i in range(BQ * D // TPB):
            e = tid + i * TPB
            r = e // D
            c = e - r * D
            tq = qt0 + r
            if tq < T:
                gate = proj[tq, 2 * D * h + D + c]
                out[tq, h * D + c] = smem_f[r * OW + c] * column_scale(v_cache, c) / (np.float32(1.0)
                                                                                     + math.exp(-gate))
    return finish


def f16_cache_hooks(ts: TileShape):
    """(head_base, load_k, load_v, finish) of the float16 cache: K / V tiles by cp.async from [Hkv, max_seq,
    d] caches (head_base: the flat cache row of a KV head's key 0), output o ⊙ σ(gate)."""
    D, TPB, RW = ts.D, ts.TPB, ts.RW
    CH = D // 8                  # 16-byte chunks per row
    KV_ITERS = (BK * CH + TPB - 1) // TPB

    @cuda.jit(device=True, inline=True)
    def head_base(cache, kvh):
        return kvh * cache.shape[1]

    @cuda.jit(device=True, inline=True)
    def load_kv_tile(smem, off, cache, kv_row0, kt0, kv_hi):
        """cp.async rows kt0..kt0+BK-1 of one KV head (cache rows kv_row0 + ...) into smem[off:], one group.
        Rows at or past kv_hi are zero-filled with plain stores."""
        tid = cuda.threadIdx.x
        for i in range(KV_ITERS):
            e = tid + i * TPB
            r = e // CH
            c = e - r * CH
            dst = off + r * RW + 4 * c
            if r < BK:
                if kt0 + r < kv_hi:
                    ptx.cp_async_16(smem, dst, cache, (kv_row0 + kt0 + r) * D + 8 * c)
                else:
                    zero_words(smem, dst)
        ptx.cp_async_commit()

    @cuda.jit(device=True, inline=True)
    def as_staged(smem_f, v_cache, tid):
        return

    @cuda.jit(device=True, inline=True)
    def unscaled(v_cache, c):
        return np.float32(1.0)

    return head_base, load_kv_tile, load_kv_tile, gated_finish(ts, as_staged, unscaled)


def _hooks(cache: tuple | None, ts: TileShape):
    if cache is None:
        return f16_cache_hooks(ts)
    from ninfer_numba.kernels.kvq.prefill import coded_cache_hooks     # it builds on this module
    return coded_cache_hooks(ts, *cache)


@lru_cache(maxsize=None)
def _prefill_mma_kernel(H: int, Hkv: int, D: int, n_warps: int, cache: tuple | None = None):
    """cache: None for float16 caches; (k_bits, v_bits) for a coded one (kvq/prefill.py: k_cache and v_cache
    are then tuples of its arrays)."""
    G = H // Hkv
    ts = TileShape(D, n_warps)
    BQ, TPB, RW, OW = ts.BQ, ts.TPB, ts.RW, ts.OW
    DW = D // 2                  # data words per row
    KSTEPS = D // 16             # k16 steps of Q Kᵀ
    NT = D // 8                  # n8 tiles of O per warp
    O_REGS = 4 * NT              # shapes of local arrays must be plain constants
    S_REGS = BK // 2
    P_REGS = BK // 4
    Q_OFF = 0
    K_OFF = BQ * RW
    V_OFF = K_OFF + BK * RW
    scale_log2 = np.float32(LOG2E / math.sqrt(D))
    f0 = np.float32(0.0)
    head_base, load_k_tile, load_v_tile, finish = _hooks(cache, ts)

    # ≤ 255 registers: with 4 warps two blocks share an SM (2 × 101 KiB of shared memory fits 227 KiB)
    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, max(1, 8 // n_warps))}

    @cached_jit(**occupancy)
    def kernel(q, k_cache, v_cache, pos0_buf, proj, out):
        # dynamic arrays take numba dtypes: the simulator sizes them from dtype.itemsize
        smem = cuda.shared.array(0, types.uint32, alignment=16)      # Q | K | V tiles (module docstring)
        smem_f = cuda.shared.array(0, types.float32, alignment=16)   # the same bytes (dynamic arrays alias)
        acc_o = cuda.local.array(O_REGS, np.float32)             # O fragments [n8 tile, c0..c3], flat
        acc_s = cuda.local.array(S_REGS, np.float32)             # S / P fragments [n8 tile, c0..c3], flat
        p_frag = cuda.local.array(P_REGS, np.uint32)             # P as f16 A fragments [k16 step, a0..a3]
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        T = q.shape[0]
        qt0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BQ       # longest (latest) query tiles start first
        h = cuda.blockIdx.y
        kv_row0 = head_base(k_cache, h // G)                    # where this KV head's keys start
        pos0 = pos0_buf[0]
        kv_hi = pos0 + min(qt0 + BQ, T)                         # keys needed by the tile's last valid row
        n_tiles = (kv_hi + BK - 1) // BK

        load_k_tile(smem, K_OFF, k_cache, kv_row0, 0, kv_hi)  # K tile 0 flies while Q is converted
        for i in range(BQ * DW // TPB):
            e = tid + i * TPB
            r = e // DW
            c = e - r * DW
            tq = qt0 + r
            lo = f0
            hi = f0
            if tq < T:
                lo = np.float32(q[tq, h, 2 * c])
                hi = np.float32(q[tq, h, 2 * c + 1])
            smem[Q_OFF + r * RW + c] = pack_f16x2(lo, hi)

        # ldmatrix row addresses of this lane (word index), per docstring of mma_f16.py:
        # Q A-fragment: matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15) of the warp's 16 rows
        qa = Q_OFF + (16 * warp + (lane & 15)) * RW + 4 * (lane >> 4)
        # K B-fragments of two n8 tiles: (keys 0-7, dims 0-7 | 8-15), then keys 8-15
        kb = K_OFF + ((lane & 7) + 8 * (lane >> 4)) * RW + 4 * ((lane >> 3) & 1)
        # V (transposed) B-fragments of two n8 dim tiles: (keys 0-7 | 8-15, dims 0-7), then dims 8-15
        vb = V_OFF + ((lane & 7) + 8 * ((lane >> 3) & 1)) * RW + 4 * (lane >> 4)
        warp_pos = pos0 + qt0 + 16 * warp                       # cache position of the warp's row 0
        row_pos = warp_pos + g                                  # fragment row g; row g + 8 is + 8

        for i in range(4 * NT):
            acc_o[i] = f0
        m0 = NEG_INF                                            # running max (log2 domain), rows g, g+8
        m1 = NEG_INF
        l0 = f0                                                 # this lane's share of the row sums
        l1 = f0

        for it in range(n_tiles):
            kt0 = it * BK
            ptx.cp_async_wait_all()
            cuda.syncthreads()          # K(it) (and Q) visible; every warp finished P V(it-1): V is free
            load_v_tile(smem, V_OFF, v_cache, kv_row0, kt0, kv_hi)

            for i in range(BK // 2):
                acc_s[i] = f0
            for kk in range(KSTEPS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, qa + 8 * kk)
                for jp in range(BK // 16):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, kb + 16 * jp * RW + 8 * kk)
                    mma_into(acc_s, 8 * jp, a0, a1, a2, a3, b0, b1)        # n8 tile 2jp
                    mma_into(acc_s, 8 * jp + 4, a0, a1, a2, a3, b2, b3)    # n8 tile 2jp + 1

            masked = kt0 + BK - 1 > warp_pos                    # warp-uniform: tile crosses the diagonal
            mx0 = NEG_INF
            mx1 = NEG_INF
            for j in range(BK // 8):
                for e in range(4):
                    x = acc_s[4 * j + e] * scale_log2
                    if masked and kt0 + 8 * j + 2 * t + (e & 1) > row_pos + 8 * (e >> 1):
                        x = NEG_INF
                    acc_s[4 * j + e] = x
                mx0 = max(mx0, max(acc_s[4 * j], acc_s[4 * j + 1]))
                mx1 = max(mx1, max(acc_s[4 * j + 2], acc_s[4 * j + 3]))
            # the 4 lanes of a quad hold one row's 64 keys
            mx0 = max(mx0, ptx.shfl_xor_f32(mx0, 1))
            mx0 = max(mx0, ptx.shfl_xor_f32(mx0, 2))
            mx1 = max(mx1, ptx.shfl_xor_f32(mx1, 1))
            mx1 = max(mx1, ptx.shfl_xor_f32(mx1, 2))
            mn0 = max(m0, mx0)
            mn1 = max(m1, mx1)
            # ex2.approx alone: libdevice's exp2f scales and squares around the MUFU for subnormal results,
            # three more instructions for every score (weights below 2^-126 are 0 in the f16 P anyway)
            alpha0 = ptx.ex2_approx(m0 - mn0)                   # 0 on the first tile (m = -inf)
            alpha1 = ptx.ex2_approx(m1 - mn1)
            m0 = mn0
            m1 = mn1
            s0 = f0
            s1 = f0
            for j in range(BK // 8):
                p0 = ptx.ex2_approx(acc_s[4 * j] - m0)
                p1 = ptx.ex2_approx(acc_s[4 * j + 1] - m0)
                p2 = ptx.ex2_approx(acc_s[4 * j + 2] - m1)
                p3 = ptx.ex2_approx(acc_s[4 * j + 3] - m1)
                s0 += p0 + p1
                s1 += p2 + p3
                # n8 tile j is half (j & 1) of k16 step j >> 1: rows g in a0 / a2, rows g + 8 in a1 / a3
                p_frag[4 * (j >> 1) + 2 * (j & 1)] = pack_f16x2(p0, p1)
                p_frag[4 * (j >> 1) + 2 * (j & 1) + 1] = pack_f16x2(p2, p3)
            l0 = l0 * alpha0 + s0
            l1 = l1 * alpha1 + s1
            for n in range(NT):
                acc_o[4 * n] *= alpha0
                acc_o[4 * n + 1] *= alpha0
                acc_o[4 * n + 2] *= alpha1
                acc_o[4 * n + 3] *= alpha1

            ptx.cp_async_wait_all()
            cuda.syncthreads()          # V(it) visible; every warp finished Q K(it)ᵀ: K is free
            if it + 1 < n_tiles:
                load_k_tile(smem, K_OFF, k_cache, kv_row0, kt0 + BK, kv_hi)

            for ks in range(BK // 16):
                for dp in range(D // 16):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, vb + 16 * ks * RW + 8 * dp)
                    a0, a1, a2, a3 = p_frag[4 * ks], p_frag[4 * ks + 1], p_frag[4 * ks + 2], p_frag[4 * ks + 3]
                    mma_into(acc_o, 8 * dp, a0, a1, a2, a3, b0, b1)        # dims 16dp .. 16dp+7
                    mma_into(acc_o, 8 * dp + 4, a0, a1, a2, a3, b2, b3)    # dims 16dp+8 .. 16dp+15

        l0 += ptx.shfl_xor_f32(l0, 1)                           # full row sums from the quad's shares
        l0 += ptx.shfl_xor_f32(l0, 2)
        l1 += ptx.shfl_xor_f32(l1, 1)
        l1 += ptx.shfl_xor_f32(l1, 2)
        inv0 = np.float32(1.0) / l0
        inv1 = np.float32(1.0) / l1
        # O/l goes through shared memory (fp32 [BQ, OW]) so the gate reads and output stores are coalesced;
        # writing the fragments straight out would also index acc_o by a runtime loop variable
        cuda.syncthreads()              # every warp finished its last P V: the tiles are free
        o_row = (16 * warp + g) * OW + 2 * t                    # (fragment row g, dim 2t)
        for n in range(NT):
            smem_f[o_row + 8 * n] = acc_o[4 * n] * inv0
            smem_f[o_row + 8 * n + 1] = acc_o[4 * n + 1] * inv0
            smem_f[o_row + 8 * OW + 8 * n] = acc_o[4 * n + 2] * inv1
            smem_f[o_row + 8 * OW + 8 * n + 1] = acc_o[4 * n + 3] * inv1
        cuda.syncthreads()
        finish(smem_f, qt0, T, h, proj, out, v_cache)

    return kernel


def attention_prefill_mma(q, k_cache, v_cache, pos0_buf, proj, out, *, stream=0) -> None:
    """Gated causal attention of T queries at positions pos0..pos0+T-1 over cache rows [0, pos0+T).

    q:        [T, H, d] float32 or float16 (rounded to f16 for the tensor cores)
    k_cache:  [Hkv, max_seq, d] float16, C-contiguous, 16-byte aligned; v_cache likewise
              (rows pos0..pos0+T-1 already stored)
    pos0_buf: [1] int32 device array, position of query row 0
    proj:     [T, 2·d·H + 2·d·Hkv] float32 (gate of head h at columns [2dh+d, 2d(h+1)))
    out:      [T, H·d] float32, o ⊙ σ(gate)
    d a multiple of 16 up to 256, H a multiple of Hkv (``supports_shape``). Needs sm_80+.
    """
    launch_prefill_mma(q, k_cache, v_cache, pos0_buf, proj, out, stream=stream)


def launch_prefill_mma(q, k_cache, v_cache, pos0_buf, proj, out, *, stream=0, n_warps: int = N_WARPS) -> None:
    """``attention_prefill_mma`` with a chosen block size (4 or 8 warps of 16 query rows), for benchmarks."""
    T, H, D = q.shape
    Hkv = k_cache.shape[0]
    if not supports_shape(H, Hkv, D) or n_warps not in (4, 8):
        raise ValueError(f"unsupported mma prefill shape H={H} Hkv={Hkv} d={D} n_warps={n_warps} "
                         f"(d % 16 == 0, 16 <= d <= {MAX_D}, H % Hkv == 0)")
    if T == 0:
        return
    launch_kernel(Hkv, n_warps, None, (q, k_cache, v_cache, pos0_buf, proj, out), stream)


def launch_kernel(Hkv: int, n_warps: int, cache: tuple | None, args: tuple, stream) -> None:
    """The kernel of this cache variant (_prefill_mma_kernel's ``cache``) on args (q first), its dynamic
    shared memory allowed."""
    T, H, D = args[0].shape
    kernel = _prefill_mma_kernel(H, Hkv, D, n_warps, cache)
    nbytes = smem_bytes(D, n_warps)
    allow_dynamic_smem(kernel, args, nbytes)
    kernel[launch_grid(T, H, n_warps), 32 * n_warps, stream, nbytes](*args)
