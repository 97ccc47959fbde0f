"""Decode attention over the 3/4-bit KV cache, in the rotated domain (kvq/ref.py's attention_rotated_ref for
one query token): no cached vector is ever rotated back.

Split-K over the cached tokens, two kernels on one stream:
  partial  grid (n_splits, H), NW warps. The block rotates its query head by the keys' rotation (signs, the
           Walsh-Hadamard butterflies in shared memory, / sqrt(d)). Warp w takes keys w, w + NW, ... of the
           split; lane l < d/8 owns coordinates 8l..8l+7, whose 8 codes are one 3-byte group (3 bits) or one
           4-byte word (4 bits) of the packed row. A key's score is (q_rot · level[c]) · n / d (the cached
           vector is level[c] · n / sqrt(d), the attention scale 1 / sqrt(d)), summed over the lanes by
           shuffles; an online softmax per warp accumulates p · level_v[c] · n_v / sqrt(d) per coordinate.
           The warps' (max, sum, accumulator) are merged in shared memory into the split's partial.
  combine  grid (H,): the splits merged, divided by the softmax sum, rotated back by the values' rotation.
The output is the attention of the head before the model's output gate, as flash_attn.decode's partials
are before theirs.

Buffers: q [H, d] f32 or f16 (roped, normed: the model's f16 query buffer); k_codes, v_codes
[Hkv, max_seq, d·bits/8] uint8; k_norms, v_norms [Hkv, max_seq] uint16 (float16 bits); kv_len [1] int32 (tokens cached, this one's included); part_o
[n_splits, H, d] f32 and part_ml [n_splits, H, 2] f32 (workspace); out [H, d] f32.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import float32, uint32

from ninfer_numba.kernels.flash_attn.decode import h2_to_f32
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.reduce import row_sum_f32

NW = 4                      # warps per partial block
TPB = 32 * NW
NEG_INF = float32(-np.inf)


@cuda.jit(device=True, inline=True)
def _lane_codes(codes, h, j, lane, bits, out):
    """The 8 codes of coordinates 8·lane .. 8·lane + 7 of cached row (h, j) into out[0:8]."""
    if bits == 4:
        for k in range(4):
            byte = uint32(codes[h, j, 4 * lane + k])
            out[2 * k] = byte & uint32(15)
            out[2 * k + 1] = byte >> uint32(4)
    else:
        word = (uint32(codes[h, j, 3 * lane]) | (uint32(codes[h, j, 3 * lane + 1]) << uint32(8))
                | (uint32(codes[h, j, 3 * lane + 2]) << uint32(16)))
        for k in range(8):
            out[k] = (word >> uint32(3 * k)) & uint32(7)


@cuda.jit(device=True)
def fwht_shared(s_x, d, tid, nthreads):
    """In-place Walsh-Hadamard butterflies of s_x[0:d] by a block of nthreads (barriers included)."""
    half = 1
    while half < d:
        for p in range(tid, d // 2, nthreads):
            a = (p // half) * 2 * half + p % half
            u = s_x[a]
            v = s_x[a + half]
            s_x[a] = u + v
            s_x[a + half] = u - v
        cuda.syncthreads()
        half *= 2


@lru_cache(maxsize=None)
def _kernels(H: int, Hkv: int, d: int, k_bits: int, v_bits: int, n_splits: int, gated: bool = False):
    if d % 8 or d > 256 or d & (d - 1) or H % Hkv:
        raise ValueError(f"unsupported kvq decode: H={H}, Hkv={Hkv}, d={d} (a power of two, 8 <= d <= 256)")
    G = H // Hkv
    LANES = d // 8               # lanes holding coordinates (8 each)
    INV_SQRT_D = float32(1.0 / math.sqrt(d))
    INV_D = float32(1.0 / d)

    @cached_jit()
    def partial(q, k_codes, k_norms, v_codes, v_norms, kv_len, k_signs, k_levels, v_levels, part_o, part_ml):
        s_q = cuda.shared.array(d, float32)                 # the rotated query
        s_lk = cuda.shared.array(16, float32)               # key / value codebooks
        s_lv = cuda.shared.array(16, float32)
        s_m = cuda.shared.array(NW, float32)
        s_l = cuda.shared.array(NW, float32)
        s_acc = cuda.shared.array((NW, d), float32)
        split = cuda.blockIdx.x
        h = cuda.blockIdx.y
        hk = h // G
        tid = cuda.threadIdx.x
        w = tid >> 5
        lane = tid & 31
        for i in range(tid, d, TPB):
            s_q[i] = float32(q[h, i]) * k_signs[i]
        if tid < k_levels.shape[0]:
            s_lk[tid] = k_levels[tid]
        if tid < v_levels.shape[0]:
            s_lv[tid] = v_levels[tid]
        cuda.syncthreads()
        fwht_shared(s_q, d, tid, TPB)
        qv = cuda.local.array(8, float32)
        acc = cuda.local.array(8, float32)
        cv = cuda.local.array(8, uint32)
        for k in range(8):
            qv[k] = s_q[8 * lane + k] * INV_SQRT_D if lane < LANES else float32(0.0)
            acc[k] = float32(0.0)
        n_kv = kv_len[0]
        per = (n_kv + n_splits - 1) // n_splits
        j_end = min(n_kv, (split + 1) * per)
        m = NEG_INF
        lsum = float32(0.0)
        for j in range(split * per + w, j_end, NW):           # warp-uniform: every lane takes the same keys
            dot = float32(0.0)
            if lane < LANES:
                _lane_codes(k_codes, hk, j, lane, k_bits, cv)
                for k in range(8):
                    dot += qv[k] * s_lk[cv[k]]
            dot = row_sum_f32(dot, 32)
            kn, _ = h2_to_f32(uint32(k_norms[hk, j]))
            score = dot * kn * INV_D
            m_new = max(m, score)
            alpha = math.exp(m - m_new)
            p = math.exp(score - m_new)
            lsum = lsum * alpha + p
            m = m_new
            if lane < LANES:
                vn, _ = h2_to_f32(uint32(v_norms[hk, j]))
                pv = p * vn * INV_SQRT_D
                _lane_codes(v_codes, hk, j, lane, v_bits, cv)
                for k in range(8):
                    acc[k] = acc[k] * alpha + pv * s_lv[cv[k]]
        if lane == 0:
            s_m[w] = m
            s_l[w] = lsum
        if lane < LANES:
            for k in range(8):
                s_acc[w, 8 * lane + k] = acc[k]
        cuda.syncthreads()
        mm = NEG_INF
        for u in range(NW):
            mm = max(mm, s_m[u])
        for i in range(tid, d, TPB):
            o = float32(0.0)
            if mm != NEG_INF:
                for u in range(NW):
                    if s_m[u] != NEG_INF:
                        o += s_acc[u, i] * math.exp(s_m[u] - mm)
            part_o[split, h, i] = o
        if tid == 0:
            ll = float32(0.0)
            if mm != NEG_INF:
                for u in range(NW):
                    if s_m[u] != NEG_INF:
                        ll += s_l[u] * math.exp(s_m[u] - mm)
            part_ml[split, h, 0] = mm
            part_ml[split, h, 1] = ll

    @cached_jit()
    def combine(part_o, part_ml, v_signs, proj, out):
        # gated: out [H·d] = o ⊙ σ(gate), the gate at proj[0, 2dh + d + i] (flash_attn/ref.py's layout);
        # else out [H, d] = o
        s_o = cuda.shared.array(d, float32)
        h = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        mm = NEG_INF
        for s in range(n_splits):
            mm = max(mm, part_ml[s, h, 0])
        ll = float32(0.0)
        for s in range(n_splits):
            if part_ml[s, h, 0] != NEG_INF:
                ll += part_ml[s, h, 1] * math.exp(part_ml[s, h, 0] - mm)
        for i in range(tid, d, TPB):
            o = float32(0.0)
            for s in range(n_splits):
                if part_ml[s, h, 0] != NEG_INF:
                    o += part_o[s, h, i] * math.exp(part_ml[s, h, 0] - mm)
            s_o[i] = o / ll
        cuda.syncthreads()
        fwht_shared(s_o, d, tid, TPB)
        for i in range(tid, d, TPB):
            o = s_o[i] * v_signs[i] * INV_SQRT_D
            if gated:
                out[h * d + i] = o / (float32(1.0) + math.exp(-proj[0, 2 * d * h + d + i]))
            else:
                out[h, i] = o

    return partial, combine


class KvqDecodeWorkspace:
    """Split-K partials for H heads of size d."""

    def __init__(self, H: int, d: int, n_splits: int, stream=0) -> None:
        self.n_splits = n_splits
        self.part_o = cuda.to_device(np.zeros((n_splits, H, d), np.float32), stream=stream)    # [S, H, d]
        self.part_ml = cuda.to_device(np.zeros((n_splits, H, 2), np.float32), stream=stream)   # [S, H, 2]
        self.no_gate = cuda.to_device(np.zeros((1, 1), np.float32), stream=stream)  # proj's stand-in, ungated


def kvq_attention_decode(q, k_codes, k_norms, v_codes, v_norms, kv_len, k_tables: KvqTables,
                         v_tables: KvqTables, out, ws: KvqDecodeWorkspace, stream=0, proj=None) -> None:
    """out [H, d] = attention of this token's q [H, d] over the first kv_len[0] cached tokens (module
    docstring for the layouts); k_tables / v_tables: the roles' rotation signs and codebooks. With proj
    ([1, P], the layer's fused projection row) the output gate is applied and out is [H·d], as
    flash_attn.decode.attention_decode writes it."""
    H, d = q.shape
    Hkv = k_codes.shape[0]
    gated = proj is not None
    partial, combine = _kernels(H, Hkv, d, k_tables.bits, v_tables.bits, ws.n_splits, gated)
    partial[(ws.n_splits, H), TPB, stream](q, k_codes, k_norms, v_codes, v_norms, kv_len, k_tables.signs,
                                           k_tables.levels, v_tables.levels, ws.part_o, ws.part_ml)
    combine[H, TPB, stream](ws.part_o, ws.part_ml, v_tables.signs, proj if gated else ws.no_gate, out)
