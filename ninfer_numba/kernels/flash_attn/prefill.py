"""Causal GQA prefill attention over the f16 cache: tiled online softmax (FlashAttention-2), float32 FMA.

Block (query tile, query head h): BQ = 32 queries at positions pos0+qt0 .. pos0+qt0+31 attend to cache
rows [0, pos0 + min(qt0+BQ, T)) in tiles of BK = 32 keys of KV head h // (H/Hkv). Per key tile:

    S  = (Q Kᵀ)/√d   [BQ, BK]   d is walked in chunks of DC dims staged in shared memory;
                                each thread owns a 2-row × 4-key micro-tile of S
    m' = max(m, rowmax S);  P = exp(S − m');  l = l·e^(m−m') + rowsum P     (one thread per row)
    O  = O·e^(m−m') + P V        [BQ, d]    V tile [BK, d] staged as float32; each thread owns
                                            4 rows × d/16 dims of O in registers
and at the end out[t, h·d + i] = O/l · σ(gate).

Causal mask, query row r, key column j of tile kt0 (cache positions):

    key position kt0 + j  ≤  pos0 + qt0 + r      and      kt0 + j < pos0 + T

Row 0 of every query attends to key 0, which sits in the first tile, so the running max is finite after
the first tile; fully masked rows of a later tile get P = 0. Query rows past T compute but never store.

This is the correctness-first float32 version (no tensor cores): ~1/15 of the fp16 mma rate at best.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda

PF_TPB = 128          # threads per block
BQ = 32               # query rows per block
BK = 32               # keys per tile
MAX_D = 256           # V tile [BK, d] float32 = 32 KiB of the 48 KiB static shared memory
NEG_INF = -math.inf


def _dim_chunk(D: int) -> int:
    for dc in (64, 32, 16):
        if D % dc == 0:
            return dc
    raise ValueError(f"prefill needs a head dim divisible by 16, got {D}")


@lru_cache(maxsize=None)
def _prefill_kernel(H: int, Hkv: int, D: int):
    G = H // Hkv
    DC = _dim_chunk(D)
    QS = DC + 1                        # row stride of the Q and K chunks: odd, bank-conflict free
    SS = BK + 1                        # row stride of S / P
    NC = D // 16                       # output dims per thread in the PV phase (dims dg + 16·c)
    ACC = 4 * NC                       # 4 rows × NC dims of O per thread
    SBUF = max(BQ * QS + BK * QS, BK * D)   # Q|K chunks during S, then the V tile: same buffer
    SSZ = BQ * SS
    scale = np.float32(1.0 / math.sqrt(D))

    @cached_jit()
    def kernel(q, k_cache, v_cache, pos0_buf, proj, out):
        qt0 = cuda.blockIdx.x * BQ
        h = cuda.blockIdx.y
        kh = h // G
        tid = cuda.threadIdx.x
        T = q.shape[0]
        pos0 = pos0_buf[0]
        kv_end = pos0 + T
        kv_hi = pos0 + min(qt0 + BQ, T)                    # keys needed by this tile's last valid row
        s_buf = cuda.shared.array(SBUF, np.float32)
        s_s = cuda.shared.array(SSZ, np.float32)           # [BQ, BK+1] scores, then probabilities
        s_m = cuda.shared.array(BQ, np.float32)            # running row max
        s_l = cuda.shared.array(BQ, np.float32)            # running row sum
        s_alpha = cuda.shared.array(BQ, np.float32)        # e^(m_old − m_new) of the current tile
        if tid < BQ:
            s_m[tid] = NEG_INF
            s_l[tid] = 0.0
        # S micro-tile: rows 2·(tid//8) + {0,1}, keys tid%8 + 8·{0..3}
        sr = 2 * (tid // 8)
        sk = tid % 8
        # O micro-tile: rows 4·(tid//16) + {0..3}, dims tid%16 + 16·{0..NC-1}
        orow = 4 * (tid // 16)
        odim = tid % 16
        acc_s = cuda.local.array(8, np.float32)
        acc_o = cuda.local.array(ACC, np.float32)
        for e in range(ACC):
            acc_o[e] = 0.0
        for kt0 in range(0, kv_hi, BK):
            for e in range(8):
                acc_s[e] = 0.0
            for d0 in range(0, D, DC):
                for e in range(tid, BQ * DC, PF_TPB):
                    r = e // DC
                    i = e - r * DC
                    t = qt0 + r
                    s_buf[r * QS + i] = np.float32(q[t, h, d0 + i]) if t < T else np.float32(0.0)
                    kp = kt0 + r                           # BK == BQ: the same (r, i) walks the K chunk
                    s_buf[BQ * QS + r * QS + i] = (np.float32(k_cache[kh, kp, d0 + i]) if kp < kv_hi
                                                   else np.float32(0.0))
                cuda.syncthreads()
                for i in range(DC):
                    qa = s_buf[sr * QS + i]
                    qb = s_buf[(sr + 1) * QS + i]
                    for c in range(4):
                        kv = s_buf[BQ * QS + (sk + 8 * c) * QS + i]
                        acc_s[c] += qa * kv
                        acc_s[4 + c] += qb * kv
                cuda.syncthreads()                         # the next chunk (or the V tile) overwrites s_buf
            for a in range(2):
                qpos = pos0 + qt0 + sr + a
                for c in range(4):
                    kp = kt0 + sk + 8 * c
                    ok = kp <= qpos and kp < kv_end
                    s_s[(sr + a) * SS + sk + 8 * c] = acc_s[4 * a + c] * scale if ok else NEG_INF
            for e in range(tid, BK * D, PF_TPB):           # V tile rows are contiguous in the cache
                j = e // D
                i = e - j * D
                kp = kt0 + j
                s_buf[e] = np.float32(v_cache[kh, kp, i]) if kp < kv_hi else np.float32(0.0)
            cuda.syncthreads()
            if tid < BQ:                                   # online softmax, one thread per row
                m_old = s_m[tid]
                m_new = m_old
                for j in range(BK):
                    m_new = max(m_new, s_s[tid * SS + j])
                l_new = np.float32(0.0)
                for j in range(BK):
                    p = math.exp(s_s[tid * SS + j] - m_new)
                    s_s[tid * SS + j] = p
                    l_new += p
                alpha = math.exp(m_old - m_new)            # 0 on the first tile (m_old = -inf)
                s_alpha[tid] = alpha
                s_l[tid] = s_l[tid] * alpha + l_new
                s_m[tid] = m_new
            cuda.syncthreads()
            for a in range(4):
                al = s_alpha[orow + a]
                for c in range(NC):
                    acc_o[a * NC + c] *= al
            for j in range(BK):
                for a in range(4):
                    p = s_s[(orow + a) * SS + j]
                    for c in range(NC):
                        acc_o[a * NC + c] += p * s_buf[j * D + odim + 16 * c]
            cuda.syncthreads()                             # next tile overwrites s_buf and s_s
        for a in range(4):
            t = qt0 + orow + a
            if t < T:
                inv_l = np.float32(1.0) / s_l[orow + a]
                for c in range(NC):
                    i = odim + 16 * c
                    gate = proj[t, 2 * D * h + D + i]
                    out[t, h * D + i] = acc_o[a * NC + c] * inv_l / (np.float32(1.0) + math.exp(-gate))

    return kernel


def attention_prefill(q, k_cache, v_cache, pos0_buf, proj, out, *, stream=0) -> None:
    """Gated causal attention of T queries at positions pos0..pos0+T-1 over cache rows [0, pos0+T).

    q:        [T, H, d] float32 or float16 (rotated queries, qk_norm_rope_store's q_out)
    k_cache:  [Hkv, max_seq, d] float16; v_cache likewise (rows pos0..pos0+T-1 already stored)
    pos0_buf: [1] int32 device array, position of query row 0
    proj:     [T, 2·d·H + 2·d·Hkv] float32 (gate of head h at columns [2dh+d, 2d(h+1)))
    out:      [T, H·d] float32, o ⊙ σ(gate)
    d must be a multiple of 16 and at most 256; H a multiple of Hkv.
    """
    T, H, D = q.shape
    Hkv = k_cache.shape[0]
    if D > MAX_D or D % 16 or H % Hkv:
        raise ValueError(f"unsupported prefill shape H={H} Hkv={Hkv} d={D} (d % 16 == 0, d <= {MAX_D})")
    if T == 0:
        return
    kernel = _prefill_kernel(H, Hkv, D)
    kernel[((T + BQ - 1) // BQ, H), PF_TPB, stream](q, k_cache, v_cache, pos0_buf, proj, out)
