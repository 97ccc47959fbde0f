"""Split-K decode attention over the f16 KV cache, output gate fused in the combine.

One new query token. The cache [0, kv_len) of each KV head is cut into ``n_splits`` contiguous ranges;
block (s, kh) reads range s of KV head kh once and serves all G = H/Hkv query heads of that head (GQA),
so every cache byte is read once per step. Each block leaves an unnormalised partial output with its
running max m and sum l (online softmax); the combine kernel rescales the partials of one query head by
exp(m_s − M), sums, divides by Σ l_s·exp(m_s − M) and multiplies by σ(gate).

kv_len is read from a device buffer, so one captured graph serves every step: the grid is fixed by
n_splits, and each block derives its range from kv_len (ranges are rounded up to whole tiles of BK keys;
blocks past the end return at once).

Per tile of BK keys a block (1) copies the contiguous K tile [BK, d] into shared memory as float32,
(2) computes the G×BK scores with each warp taking a quarter of d for all G heads (one K read feeds G
FMAs; q·(1/√d) sits in shared memory and is read as a broadcast), (3) sums the quarters, (4) updates
m, l per head, (5) accumulates p·V with each thread owning d/TPB output dims for all G heads in
registers, reading V straight from global memory (consecutive threads read consecutive dims).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ninfer_numba.kernels.numba_env import cuda

DEC_TPB = 128                     # threads per block: 4 warps
DEC_BK = 32                       # keys per tile
DEC_WARPS = DEC_TPB // DEC_BK     # the d-slices of the score phase
MAX_D = 256                       # K tile [BK, d+1] float32 must fit the 48 KiB of static shared memory
MAX_G = 8
NEG_INF = -math.inf


@cuda.jit(device=True)
def split_range_len(kv_len, n_splits):
    """Keys per split: ceil(kv_len / n_splits) rounded up to whole tiles (shared by both kernels)."""
    per = (kv_len + n_splits - 1) // n_splits
    return ((per + DEC_BK - 1) // DEC_BK) * DEC_BK


@lru_cache(maxsize=None)
def _decode_kernels(H: int, Hkv: int, D: int):
    G = H // Hkv
    KS = D + 1                                    # K tile row stride: odd, so lanes reading rows j hit distinct banks
    DQ = (D + DEC_WARPS - 1) // DEC_WARPS         # dims per warp in the score phase
    C = (D + DEC_TPB - 1) // DEC_TPB              # output dims per thread in the PV phase
    scale = np.float32(1.0 / math.sqrt(D))
    # shared and local array sizes must be compile-time constants: precompute them here
    SQ, SK, SPART, SP, GC = G * D, DEC_BK * KS, DEC_WARPS * G * DEC_BK, G * DEC_BK, G * C

    @cuda.jit
    def partial_kernel(q, k_cache, v_cache, kv_len_buf, part_o, part_ml):
        s = cuda.blockIdx.x
        kh = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        kv_len = kv_len_buf[0]
        per = split_range_len(kv_len, cuda.gridDim.x)
        j0 = s * per
        j1 = min(j0 + per, kv_len)
        if j0 >= j1:                              # whole block leaves together: no barrier is skipped
            return
        s_q = cuda.shared.array(SQ, np.float32)            # [G, D] q·(1/√d) of the group's heads
        s_k = cuda.shared.array(SK, np.float32)      # [BK, D+1] K tile
        s_part = cuda.shared.array(SPART, np.float32)   # [WARPS, G, BK] partial scores
        s_p = cuda.shared.array(SP, np.float32)       # [G, BK] scores, then probabilities
        s_m = cuda.shared.array(G, np.float32)                # running max per head
        s_l = cuda.shared.array(G, np.float32)                # running sum per head
        s_alpha = cuda.shared.array(G, np.float32)            # rescale of the previous accumulators
        for e in range(tid, SQ, DEC_TPB):
            g = e // D
            s_q[e] = np.float32(q[0, kh * G + g, e - g * D]) * scale
        if tid < G:
            s_m[tid] = NEG_INF
            s_l[tid] = 0.0
        acc = cuda.local.array(GC, np.float32)            # [G, C] this thread's output dims
        for e in range(GC):
            acc[e] = 0.0
        part = cuda.local.array(G, np.float32)
        w = tid // DEC_BK
        jl = tid - w * DEC_BK
        i_lo = w * DQ
        i_hi = min(i_lo + DQ, D)
        cuda.syncthreads()
        for jt in range(j0, j1, DEC_BK):
            nk = min(DEC_BK, j1 - jt)
            for e in range(tid, DEC_BK * D, DEC_TPB):         # the tile is contiguous: coalesced reads
                j = e // D
                i = e - j * D
                s_k[j * KS + i] = np.float32(k_cache[kh, jt + j, i]) if j < nk else np.float32(0.0)
            cuda.syncthreads()
            for g in range(G):
                part[g] = 0.0
            for i in range(i_lo, i_hi):
                kv = s_k[jl * KS + i]
                for g in range(G):
                    part[g] += kv * s_q[g * D + i]
            for g in range(G):
                s_part[(w * G + g) * DEC_BK + jl] = part[g]
            cuda.syncthreads()
            for e in range(tid, SP, DEC_TPB):
                g = e // DEC_BK
                j = e - g * DEC_BK
                sc = np.float32(0.0)
                for ww in range(DEC_WARPS):
                    sc += s_part[(ww * G + g) * DEC_BK + j]
                s_p[e] = sc if j < nk else NEG_INF
            cuda.syncthreads()
            if tid < G:                                      # online softmax update, one thread per head
                m_old = s_m[tid]
                m_new = m_old
                for j in range(nk):
                    m_new = max(m_new, s_p[tid * DEC_BK + j])
                l_new = np.float32(0.0)
                for j in range(DEC_BK):
                    p = math.exp(s_p[tid * DEC_BK + j] - m_new)
                    s_p[tid * DEC_BK + j] = p
                    l_new += p
                alpha = math.exp(m_old - m_new)              # 0 on the first tile (m_old = -inf)
                s_alpha[tid] = alpha
                s_l[tid] = s_l[tid] * alpha + l_new
                s_m[tid] = m_new
            cuda.syncthreads()
            for g in range(G):
                a = s_alpha[g]
                for c in range(C):
                    acc[g * C + c] *= a
            for j in range(nk):
                for c in range(C):
                    i = tid + c * DEC_TPB
                    if i < D:
                        v = np.float32(v_cache[kh, jt + j, i])
                        for g in range(G):
                            acc[g * C + c] += s_p[g * DEC_BK + j] * v
            cuda.syncthreads()                               # the next tile overwrites s_k and s_p
        for g in range(G):
            for c in range(C):
                i = tid + c * DEC_TPB
                if i < D:
                    part_o[s, kh * G + g, i] = acc[g * C + c]
        if tid < G:
            part_ml[s, kh * G + tid, 0] = s_m[tid]
            part_ml[s, kh * G + tid, 1] = s_l[tid]

    @cuda.jit
    def combine_kernel(part_o, part_ml, kv_len_buf, proj, out):
        h = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        kv_len = kv_len_buf[0]
        n_splits = part_ml.shape[0]
        per = split_range_len(kv_len, n_splits)
        n_act = (kv_len + per - 1) // per                     # splits that ran (all others returned early)
        m_all = np.float32(NEG_INF)
        for s in range(n_act):
            m_all = max(m_all, part_ml[s, h, 0])
        l_all = np.float32(0.0)
        for s in range(n_act):
            l_all += part_ml[s, h, 1] * math.exp(part_ml[s, h, 0] - m_all)
        inv_l = np.float32(1.0) / l_all
        for c in range(C):
            i = tid + c * DEC_TPB
            if i < D:
                o = np.float32(0.0)
                for s in range(n_act):
                    o += part_o[s, h, i] * math.exp(part_ml[s, h, 0] - m_all)
                gate = proj[0, 2 * D * h + D + i]
                out[h * D + i] = o * inv_l / (np.float32(1.0) + math.exp(-gate))

    return partial_kernel, combine_kernel


@dataclass(frozen=True)
class DecodeWorkspace:
    """Scratch of the split-K decode, allocated once per (H, d, n_splits) and reused by every step."""
    part_o: object        # [n_splits, H, d] float32 unnormalised partial outputs
    part_ml: object       # [n_splits, H, 2] float32 running max and sum per partial

    @property
    def n_splits(self) -> int:
        return self.part_ml.shape[0]


def alloc_decode_workspace(H: int, D: int, n_splits: int = 128) -> DecodeWorkspace:
    """n_splits × Hkv blocks run per step; 128 splits × 4 KV heads keeps ~4 blocks on each of 132 SMs."""
    return DecodeWorkspace(cuda.device_array((n_splits, H, D), np.float32),
                           cuda.device_array((n_splits, H, 2), np.float32))


def attention_decode(q, k_cache, v_cache, kv_len_buf, proj, out, workspace: DecodeWorkspace, *,
                     stream=0) -> None:
    """Gated attention of one query token over cache rows [0, kv_len).

    q:          [1, H, d] float32 or float16 (rotated query, qk_norm_rope_store's q_out)
    k_cache:    [Hkv, max_seq, d] float16; v_cache likewise (this token's row already stored)
    kv_len_buf: [1] int32 device array, number of valid cache rows (≥ 1, ≤ max_seq)
    proj:       [1, 2·d·H + 2·d·Hkv] float32, the projection row (gate of head h at [2dh+d, 2d(h+1)))
    out:        [H·d] float32, o ⊙ σ(gate)
    workspace:  from alloc_decode_workspace(H, d)
    """
    H, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[0]
    if D > MAX_D or H % Hkv or H // Hkv > MAX_G:
        raise ValueError(f"unsupported decode shape H={H} Hkv={Hkv} d={D} (d <= {MAX_D}, H/Hkv <= {MAX_G})")
    partial_kernel, combine_kernel = _decode_kernels(H, Hkv, D)
    partial_kernel[(workspace.n_splits, Hkv), DEC_TPB, stream](q, k_cache, v_cache, kv_len_buf,
                                                               workspace.part_o, workspace.part_ml)
    combine_kernel[H, DEC_TPB, stream](workspace.part_o, workspace.part_ml, kv_len_buf, proj, out)
