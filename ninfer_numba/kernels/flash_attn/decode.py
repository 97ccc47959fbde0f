"""Split-K decode attention over the f16 KV cache, output gate fused in the combine.

One new query token. The cache [0, kv_len) of each KV head is cut into ``n_splits`` contiguous ranges;
block (s, kh) reads range s of KV head kh once and serves all G = H/Hkv query heads of that head (GQA),
so every cache byte is read once per step. Each block leaves an unnormalised partial output with its
running max m and sum l (online softmax, in the log2 domain: scores carry the factor log2(e)/√d, so
p = 2^(x − m)); the combine kernel (split_combine.py) rescales the partials of one query head by 2^(m_s − M), sums, divides
by Σ l_s·2^(m_s − M) and multiplies by σ(gate).

kv_len is read from a device buffer, so one captured graph serves every step: the grid is fixed by
n_splits, and each block derives its range from kv_len (ranges are rounded up to whole block steps of
NW·R keys; blocks past the end return at once).

The partial kernel streams the cache straight into registers, with no shared-memory staging and no
barrier in the loop (the kernel is bound by HBM bandwidth: every byte is used once). A warp owns whole key
rows: lane l holds dims [8l, 8l+8) of a row (one 16-byte non-coherent load per row and per K / V; d ≤ 256),
and the lane's 8 dims of q·(1/√d) for the G heads sit in registers. Per step a warp takes R consecutive
rows: it issues all 2R loads first (K and V, so 2R·16 bytes per lane are in flight), forms the R×G partial
dot products, sums them over the 32 lanes with 5 xor-shuffles each (every lane then holds every score),
updates its running (m, l) per head and rescales its accumulator, and adds p·V into its 8 dims × G
heads. Warps keep independent online-softmax states; the block merges them through shared memory once at
the end. Rows past the range are clamped to the last valid row (finite data, never out of bounds) and
get probability 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ninfer_numba.kernels.flash_attn.split_combine import COMB_TPB, split_combine_kernel, split_range_len
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.ptx import ldg_nc_v4_u32, pair_asm_intrinsic, shfl_xor_f32

DEC_WARPS = 4                     # warps per block of the partial kernel
DEC_TPB = 32 * DEC_WARPS
DEC_BLOCKS_PER_SM = 3             # launch bound: ≤ 170 registers per thread, so the loop runs without spills
LANE_DIMS = 8                     # f16 dims per lane per row: one 16-byte load
MAX_D = 32 * LANE_DIMS            # one row per warp: d ≤ 256, d a multiple of 8
MAX_G = 8
NEG_INF = -math.inf
LOG2E = 1.4426950408889634


def _rows_per_step(G: int) -> int:
    """Rows a warp loads per step: 2R 16-byte loads in flight per lane, registers ≈ 8R + 16G + RG."""
    return 4 if G <= 4 else 2


# ---------------------------------------------------------------- f16 pair → two float32 -------------

def _make_h2_to_f32():
    """h2_to_f32(w) -> (low half, high half) of a uint32 holding two f16, each converted exactly to float32."""
    if SIMULATOR:
        @cuda.jit(device=True)
        def h2_to_f32(w):
            h = np.array([int(w) & 0xFFFFFFFF], np.uint32).view(np.float16).astype(np.float32)
            return h[0], h[1]
        return h2_to_f32
    from numba import types
    return pair_asm_intrinsic("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                              types.float32)


h2_to_f32 = _make_h2_to_f32()


@lru_cache(maxsize=None)
def _decode_kernels(H: int, Hkv: int, D: int, n_splits: int):
    G = H // Hkv
    R = _rows_per_step(G)
    STEP = DEC_WARPS * R                       # rows per block step; split lengths are multiples of it
    NL = D // LANE_DIMS                        # lanes holding dims; lanes ≥ NL hold q = 0
    scale = np.float32(LOG2E / math.sqrt(D))     # scores in the log2 domain: p = 2^(x − m)
    # shared and local array sizes must be compile-time constants: precompute them here
    GL, RG, RW = G * LANE_DIMS, R * G, 4 * R
    SO, SML = DEC_WARPS * G * D, DEC_WARPS * G * 2
    occupancy = {} if SIMULATOR else {"launch_bounds": (DEC_TPB, DEC_BLOCKS_PER_SM)}

    @cached_jit(pdl=True, **occupancy)
    def partial_kernel(q, k_cache, v_cache, kv_len_buf, slots, part_o, part_ml):
        # q [B, H, D] f32 / f16, k_cache and v_cache [n_slots·Hkv, max_seq, D] f16, kv_len_buf [B] i32,
        # slots [B] i32 (batch row -> cache slot), part_o [B, n_splits, H, D] f32, part_ml [B, n_splits, H, 2]
        griddep_wait()                                # kernels/pdl.py: before any global access
        griddep_launch_dependents()
        s = cuda.blockIdx.x
        kh = cuda.blockIdx.y
        b = cuda.blockIdx.z                           # batch row: its query, length and partials
        tid = cuda.threadIdx.x
        w = tid // 32
        lane = tid - 32 * w
        kv_len = kv_len_buf[b]
        per = split_range_len(kv_len, cuda.gridDim.x, STEP)
        j0 = s * per
        j1 = min(j0 + per, kv_len)
        if j0 >= j1:                              # whole block leaves together: no barrier is skipped
            return
        max_seq = k_cache.shape[1]
        c8 = LANE_DIMS * min(lane, NL - 1)        # idle lanes re-read the last chunk, with q = 0
        row0 = (slots[b] * Hkv + kh) * max_seq       # the slot's KV head kh
        qr = cuda.local.array(GL, np.float32)     # [G, 8] q·log2(e)/√d of this lane's dims
        for g in range(G):
            for i in range(LANE_DIMS):
                qv = np.float32(q[b, kh * G + g, c8 + i]) * scale
                qr[g * LANE_DIMS + i] = qv if lane < NL else np.float32(0.0)
        acc = cuda.local.array(GL, np.float32)    # [G, 8] unnormalised Σ p·v of this lane's dims
        for e in range(GL):
            acc[e] = 0.0
        m = cuda.local.array(G, np.float32)       # running max per head (same in every lane)
        lsum = cuda.local.array(G, np.float32)    # running Σ p per head
        for g in range(G):
            m[g] = NEG_INF
            lsum[g] = 0.0
        kw = cuda.local.array(RW, np.uint32)      # [R, 4] words (8 f16) of K rows
        vw = cuda.local.array(RW, np.uint32)      # [R, 4] words of V rows
        sc = cuda.local.array(RG, np.float32)     # [R, G] scores, then probabilities
        tmp = cuda.local.array(RG, np.float32)    # [R, G] partner lanes' partial scores
        for base in range(j0 + w * R, j1, STEP):  # warp-uniform loop: shuffles see all 32 lanes
            for r in range(R):                    # all loads first
                off = (row0 + min(base + r, j1 - 1)) * D + c8
                a0, a1, a2, a3 = ldg_nc_v4_u32(k_cache, off)
                b0, b1, b2, b3 = ldg_nc_v4_u32(v_cache, off)
                kw[4 * r], kw[4 * r + 1], kw[4 * r + 2], kw[4 * r + 3] = a0, a1, a2, a3
                vw[4 * r], vw[4 * r + 1], vw[4 * r + 2], vw[4 * r + 3] = b0, b1, b2, b3
            for e in range(RG):
                sc[e] = 0.0
            for r in range(R):
                for t in range(4):
                    lo, hi = h2_to_f32(kw[4 * r + t])
                    for g in range(G):
                        sc[r * G + g] += qr[g * LANE_DIMS + 2 * t] * lo
                        sc[r * G + g] += qr[g * LANE_DIMS + 2 * t + 1] * hi
            for lvl in range(5):                  # butterfly over the lanes, one level for all scores
                mask = 16 >> lvl                  # at a time: RG independent shuffles issue back to back
                for e in range(RG):
                    tmp[e] = shfl_xor_f32(sc[e], mask)
                for e in range(RG):
                    sc[e] += tmp[e]
            for r in range(R):                    # rows past the range (clamped loads) get p = 0
                if base + r >= j1:
                    for g in range(G):
                        sc[r * G + g] = NEG_INF
            for g in range(G):                    # online softmax, redundantly in every lane
                m_new = m[g]
                for r in range(R):
                    m_new = max(m_new, sc[r * G + g])
                alpha = math.exp2(m[g] - m_new)    # 0 on the first step (m = -inf); m_new is finite
                m[g] = m_new
                psum = np.float32(0.0)
                for r in range(R):
                    p = math.exp2(sc[r * G + g] - m_new)
                    sc[r * G + g] = p
                    psum += p
                lsum[g] = lsum[g] * alpha + psum
                for i in range(LANE_DIMS):
                    acc[g * LANE_DIMS + i] *= alpha
            for r in range(R):
                for t in range(4):
                    lo, hi = h2_to_f32(vw[4 * r + t])
                    for g in range(G):
                        p = sc[r * G + g]
                        acc[g * LANE_DIMS + 2 * t] += p * lo
                        acc[g * LANE_DIMS + 2 * t + 1] += p * hi
        # merge the warps' states: M = max_w m_w, O = Σ_w O_w 2^(m_w − M), l = Σ_w l_w 2^(m_w − M)
        s_o = cuda.shared.array(SO, np.float32)       # [WARPS, G, D] per-warp accumulators
        s_ml = cuda.shared.array(SML, np.float32)     # [WARPS, G, 2] per-warp (m, l)
        if lane < NL:
            for g in range(G):
                for i in range(LANE_DIMS):
                    s_o[(w * G + g) * D + c8 + i] = acc[g * LANE_DIMS + i]
        if lane == 0:
            for g in range(G):
                s_ml[(w * G + g) * 2] = m[g]
                s_ml[(w * G + g) * 2 + 1] = lsum[g]
        cuda.syncthreads()
        for e in range(tid, G * D, DEC_TPB):
            g = e // D
            i = e - g * D
            m_all = np.float32(NEG_INF)
            for ww in range(DEC_WARPS):
                m_all = max(m_all, s_ml[(ww * G + g) * 2])
            o = np.float32(0.0)
            l_all = np.float32(0.0)
            for ww in range(DEC_WARPS):           # warps without rows: m = -inf, weight 0, O = l = 0
                f = math.exp2(s_ml[(ww * G + g) * 2] - m_all)
                o += s_o[(ww * G + g) * D + i] * f
                l_all += s_ml[(ww * G + g) * 2 + 1] * f
            part_o[b, s, kh * G + g, i] = o
            if i == 0:
                part_ml[b, s, kh * G + g, 0] = m_all
                part_ml[b, s, kh * G + g, 1] = l_all

    return partial_kernel, split_combine_kernel(D, n_splits, STEP)


@dataclass(frozen=True)
class DecodeWorkspace:
    """Scratch of the split-K decode for B batch rows, allocated once per (H, d, n_splits, B) and reused by
    every step; ``slots`` [B] int32 maps batch rows to cache slots (the identity until an engine writes its
    active sequences there)."""
    part_o: object        # [B, n_splits, H, d] float32 unnormalised partial outputs
    part_ml: object       # [B, n_splits, H, 2] float32 running max and sum per partial
    slots: object         # [B] int32

    @property
    def n_splits(self) -> int:
        return self.part_ml.shape[1]

    @property
    def batch(self) -> int:
        return self.part_ml.shape[0]


def alloc_decode_workspace(H: int, D: int, n_splits: int = 99, batch: int = 1) -> DecodeWorkspace:
    """n_splits × Hkv blocks run per step and batch row; 99 splits × 4 KV heads = 396 blocks: one full wave
    of 3 blocks (the launch bound) on each of the H200's 132 SMs, so no SM runs a second, partial wave."""
    return DecodeWorkspace(cuda.device_array((batch, n_splits, H, D), np.float32),
                           cuda.device_array((batch, n_splits, H, 2), np.float32),
                           cuda.to_device(np.arange(batch, dtype=np.int32)))


def attention_decode(q, k_cache, v_cache, kv_len_buf, proj, out, workspace: DecodeWorkspace, *,
                     kv_heads: int | None = None, stream=0) -> None:
    """Gated attention of one query token of each of B sequences over its cache rows [0, kv_len); B = 1
    takes the unbatched shapes.

    q:          [B, H, d] float32 or float16 (rotated query, qk_norm_rope_store's q_out)
    k_cache:    [n_slots·Hkv, max_seq, d] float16 (slot s holds heads [s·Hkv, (s+1)·Hkv)), or [Hkv, max_seq, d]
                for one sequence; v_cache likewise (this token's row already stored)
    kv_len_buf: [B] int32 device array, valid cache rows of each batch row (>= 1, <= max_seq)
    proj:       [B, 2·d·H + 2·d·Hkv] float32, the projection rows (gate of head h at [2dh+d, 2d(h+1)))
    out:        [B, H·d] or [H·d] float32, o ⊙ σ(gate)
    workspace:  from alloc_decode_workspace(H, d, batch=B); row b reads cache slot workspace.slots[b]
    kv_heads:   Hkv, the heads of one slot (default: k_cache holds one sequence, k_cache.shape[0])
    """
    B, H, D = q.shape
    Hkv = kv_heads or k_cache.shape[0]
    if out.ndim == 1:
        out = out.reshape(1, -1)
    if workspace.batch != B or kv_len_buf.shape[0] != B or proj.shape[0] != B or out.shape[0] != B:
        raise ValueError(f"decode batch: q has {B} rows; kv_len {kv_len_buf.shape[0]}, proj {proj.shape[0]}, "
                         f"out {out.shape[0]}, workspace {workspace.batch}")
    if D > MAX_D or D % LANE_DIMS or H % Hkv or H // Hkv > MAX_G:
        raise ValueError(f"unsupported decode shape H={H} Hkv={Hkv} d={D} "
                         f"(d <= {MAX_D} and a multiple of {LANE_DIMS}, H/Hkv <= {MAX_G})")
    n_splits = workspace.n_splits
    partial_kernel, combine_kernel = _decode_kernels(H, Hkv, D, n_splits)
    partial_kernel[(n_splits, Hkv, B), DEC_TPB, stream](q, k_cache, v_cache, kv_len_buf, workspace.slots,
                                                        workspace.part_o, workspace.part_ml)
    combine_kernel[(H, (D + 31) // 32, B), COMB_TPB, stream](workspace.part_o, workspace.part_ml, kv_len_buf,
                                                             proj, out)
