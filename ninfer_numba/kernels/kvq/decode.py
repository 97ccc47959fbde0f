"""Decode attention over the 3/4-bit KV cache, in the rotated domain (kvq/ref.py's attention_rotated_ref for
one query token): no cached vector is ever rotated back.

Split-K over the cached tokens, two kernels on one stream:
  partial  grid (n_splits, Hkv), NW warps: one block serves the G query heads of its KV head, so each coded
           row is read and unpacked once for all of them. A split is a whole number of STEP = 32·NW keys
           (split_range_len), so at short depths fewer splits run and no warp idles; the splits past kv_len
           return at once. The warps rotate the G queries by the keys' rotation (signs, Walsh-Hadamard
           butterflies in registers and by shuffles: no block barrier). Each warp takes tiles of 32
           consecutive tokens of the split (tiles w, w + NW, ...): the tile's key and value rows, contiguous
           in the cache, are copied into the warp's shared memory with coalesced word loads; then
             scores   lane r owns token r: (q_rot · level[c]) · n / d^1.5 for the G heads, its codes read
                      word by word from its shared row (rows padded to an odd stride: no bank conflicts);
             softmax  per head, online across the warp's tiles (max and sum by shuffles);
             values   lane l owns coordinates 8l .. 8l + 7: for each token of the tile, its 8 codes (one
                      24- or 32-bit group of the shared row), weights p · n_v / sqrt(d) from the token's lane.
           The warps' (max, sum, accumulator) are merged in shared memory into the split's partial, which
           the warps rotate back by the values' rotation (linear, so the rotation of each split's partial
           sums to the rotation of the merged output) and written with its maximum in the log2 domain.
  combine  flash_attn/split_combine.py's, the f16 cache's: the splits merged, divided by the softmax sum,
           gated. (Rotating back once per head after the merge took a block per head walking every split's
           maximum and sum, then the partials in dependent steps: ~17 µs per call at any depth.)
The output is the attention of the head before the model's output gate, as flash_attn.decode's partials
are before theirs.

Buffers: q [H, d] f32 or f16 (roped, normed: the model's f16 query buffer); k_codes, v_codes
[Hkv, max_seq, d·bits/8] uint8 (read as uint32 words); k_norms, v_norms [Hkv, max_seq] uint16 (float16
bits); kv_len [1] int32 (tokens cached, this one's included); part_o [n_splits, H, d] f32 and part_ml
[n_splits, H, 2] f32 (workspace); out [H, d] f32.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import float32, uint32, uint64

from ninfer_numba.kernels.flash_attn.decode import LOG2E, h2_to_f32
from ninfer_numba.kernels.flash_attn.split_combine import COMB_TPB, split_combine_kernel, split_range_len
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.ptx import shfl_idx_f32, shfl_xor_f32, syncwarp
from ninfer_numba.kernels.reduce import row_max_f32, row_sum_f32

NW = 4                      # warps per partial block
TPB = 32 * NW
STEP = 32 * NW              # a split's keys are whole multiples of this: every warp has a tile
NEG_INF = float32(-np.inf)


@cuda.jit(device=True, inline=True)
def warp_fwht(x, V, lane):
    """Walsh-Hadamard butterflies of one row of d = 32·V floats held by a warp, lane l holding coordinates
    V·l .. V·l + V - 1 in x[0:V]: strides below V inside the lane, the others by shuffles (no barrier)."""
    s = 1
    while s < V:
        for i in range(V):
            if i & s == 0:
                u = x[i]
                x[i] = u + x[i + s]
                x[i + s] = u - x[i + s]
        s *= 2
    m = 1
    while m < 32:
        for i in range(V):
            other = shfl_xor_f32(x[i], m)
            x[i] = x[i] + other if lane & m == 0 else other - x[i]
        m *= 2


def partial_smem_words(G: int, d: int, k_bits: int, v_bits: int) -> tuple[int, ...]:
    """(offsets of the rotated queries, codebooks, warp maxima and sums, tiles; total words) of the partial
    kernel's dynamic shared memory. A warp's tile: 32 key rows at odd stride WK + 1, 32 value rows at WV and
    one spare word (the last lane's 24-bit group may read one word past its row); after the loop the tile
    region holds the warps' accumulators [NW, G, d] for the merge."""
    WK, WV = d * k_bits // 32, d * v_bits // 32
    tile = 32 * (WK + 1) + 32 * WV + 1
    off_l = G * d
    off_ml = off_l + 32
    off_t = off_ml + 2 * NW * G
    return off_l, off_ml, off_t, tile, off_t + max(NW * tile, NW * G * d)


@lru_cache(maxsize=None)
def _kernels(H: int, Hkv: int, d: int, k_bits: int, v_bits: int, n_splits: int, gated: bool = False):
    if d % 32 or d > 256 or d & (d - 1) or H % Hkv:
        raise ValueError(f"unsupported kvq decode: H={H}, Hkv={Hkv}, d={d} (a power of two, 32 <= d <= 256)")
    G = H // Hkv
    V = d // 32                  # coordinates of a row per lane in the warp-held rotations
    LANES = d // 8               # lanes holding value coordinates (8 each)
    ACC = 8 * G                  # accumulator words of a lane (array sizes must be plain constants)
    WK = d * k_bits // 32        # words of a coded key row
    WV = d * v_bits // 32
    KS = WK + 1                  # key row stride in shared memory (odd)
    OFF_L, OFF_ML, OFF_T, TILE, _ = partial_smem_words(G, d, k_bits, v_bits)
    INV_SQRT_D = float32(1.0 / math.sqrt(d))
    SCORE = float32(1.0 / d ** 1.5)
    KMASK = uint32((1 << k_bits) - 1)
    VMASK = uint32((1 << v_bits) - 1)
    f0 = float32(0.0)
    # 4 blocks (16 warps) per SM: 512 blocks of the 9B's 4 KV heads x 128 splits in one wave
    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 4)}

    @cuda.jit(device=True, inline=True)
    def dot8(smem, bits, i0, dots):
        """dots[g] += Σ_k q_rot[g, i0 + k] · level_k[code k of bits] for the 8 codes packed in bits."""
        for k in range(8):
            lvl = smem[uint32(OFF_L) + ((bits >> uint32(k_bits * k)) & KMASK)]
            for g in range(G):
                dots[g] += smem[i0 + uint32(g * d + k)] * lvl

    @cuda.jit(device=True, inline=True)
    def key_dots(smem, smem_u, row, dots):
        """The G raw dot products of the coded key row at smem_u[row:] with the rotated queries. Shared-memory
        indices are uint32 throughout this loop: a signed index costs the negative-index wrap on every access
        (1,498 IMAD against 279 FFMA in the first build's SASS)."""
        for g in range(G):
            dots[g] = f0
        if k_bits == 4:
            for x in range(WK):                           # one word: 8 codes
                dot8(smem, smem_u[row + uint32(x)], uint32(8 * x), dots)
        else:
            for x in range(WK // 3):                      # three words: four 24-bit groups of 8 codes
                w0 = smem_u[row + uint32(3 * x)]
                w1 = smem_u[row + uint32(3 * x + 1)]
                w2 = smem_u[row + uint32(3 * x + 2)]
                i0 = uint32(32 * x)
                dot8(smem, w0 & uint32(0xFFFFFF), i0, dots)
                dot8(smem, (w0 >> uint32(24)) | ((w1 & uint32(0xFFFF)) << uint32(8)), i0 + uint32(8), dots)
                dot8(smem, (w1 >> uint32(16)) | ((w2 & uint32(0xFF)) << uint32(16)), i0 + uint32(16), dots)
                dot8(smem, w2 >> uint32(8), i0 + uint32(24), dots)

    @cached_jit(**occupancy)
    def partial(q, k_words, k_norms, v_words, v_norms, kv_len, k_signs, k_levels, v_levels, v_signs, part_o,
                part_ml):
        # k_words [Hkv·max_seq·WK], v_words [Hkv·max_seq·WV] uint32 (flat views of the coded caches)
        smem = cuda.shared.array(0, float32)
        smem_u = cuda.shared.array(0, uint32)             # the same bytes (dynamic arrays alias)
        split = cuda.blockIdx.x
        hk = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        w = tid >> 5
        lane = tid & 31
        max_seq = k_norms.shape[1]
        n_kv = kv_len[0]
        per = split_range_len(n_kv, n_splits, STEP)
        if split * per >= n_kv:
            return                                        # past kv_len: the combine reads no such split
        rot = cuda.local.array(V, float32)                # a row's coordinates V·lane.. in a warp rotation
        for g in range(w, G, NW):                         # s_q [G, d]: the queries · signs, rotated by warps
            for k in range(V):
                i = V * lane + k
                rot[k] = float32(q[hk * G + g, i]) * k_signs[i]
            warp_fwht(rot, V, lane)
            for k in range(V):
                smem[g * d + V * lane + k] = rot[k]
        if tid < 16:
            smem[OFF_L + tid] = k_levels[tid] if tid < k_levels.shape[0] else f0
            smem[OFF_L + 16 + tid] = v_levels[tid] if tid < v_levels.shape[0] else f0
        cuda.syncthreads()
        dots = cuda.local.array(G, float32)
        m = cuda.local.array(G, float32)
        lsum = cuda.local.array(G, float32)
        pv = cuda.local.array(G, float32)
        acc = cuda.local.array(ACC, float32)             # [head, coordinate 8·lane + k]
        lv = cuda.local.array(8, float32)                 # a value row's levels at my coordinates
        for g in range(G):
            m[g] = NEG_INF
            lsum[g] = f0
        for x in range(ACC):
            acc[x] = f0
        j_end = min(n_kv, (split + 1) * per)
        t_base = OFF_T + w * TILE
        v_base = t_base + 32 * KS
        for t0 in range(split * per + 32 * w, j_end, 32 * NW):    # warp-uniform
            nk = min(32, j_end - t0)
            row0 = hk * max_seq + t0
            for x in range(WK):                           # the tile's key rows, coalesced
                e = lane + 32 * x
                if e < nk * WK:
                    smem_u[uint32(t_base + e + e // WK)] = k_words[uint32(row0 * WK + e)]
            for x in range(WV):
                e = lane + 32 * x
                if e < nk * WV:
                    smem_u[uint32(v_base + e)] = v_words[uint32(row0 * WV + e)]
            kn = f0
            vn = f0
            if lane < nk:
                kn, _ = h2_to_f32(uint32(k_norms[hk, t0 + lane]))
                vn, _ = h2_to_f32(uint32(v_norms[hk, t0 + lane]))
            syncwarp()
            key_dots(smem, smem_u, uint32(t_base + lane * KS), dots)
            for g in range(G):                            # online softmax of head g over this tile
                score = dots[g] * kn * SCORE if lane < nk else NEG_INF
                m_new = max(m[g], row_max_f32(score, 32))
                alpha = math.exp(m[g] - m_new)
                p = math.exp(score - m_new)
                lsum[g] = lsum[g] * alpha + row_sum_f32(p, 32)
                m[g] = m_new
                pv[g] = p * vn * INV_SQRT_D
                for k in range(8):
                    acc[8 * g + k] *= alpha
            sh = uint64((v_bits * 8 * lane) & 31)          # my 8 value codes: bits 8·vb·lane.. of a row
            wi = (v_bits * 8 * lane) >> 5
            for r in range(nk):
                if lane < LANES:
                    rw = uint32(v_base + r * WV + wi)
                    bits = uint32(((uint64(smem_u[rw + uint32(1)]) << uint64(32)) | uint64(smem_u[rw])) >> sh)
                    for k in range(8):
                        lv[k] = smem[uint32(OFF_L + 16) + ((bits >> uint32(v_bits * k)) & VMASK)]
                for g in range(G):
                    pr = shfl_idx_f32(pv[g], r)
                    if lane < LANES:
                        for k in range(8):
                            acc[8 * g + k] += pr * lv[k]
            syncwarp()                      # the tile is read: the next one may overwrite it
        cuda.syncthreads()                                # tiles dead: the region holds [NW, G, d] now
        if lane < LANES:
            for g in range(G):
                for k in range(8):
                    smem[OFF_T + (w * G + g) * d + 8 * lane + k] = acc[8 * g + k]
        if lane == 0:
            for g in range(G):
                smem[OFF_ML + 2 * (w * G + g)] = m[g]
                smem[OFF_ML + 2 * (w * G + g) + 1] = lsum[g]
        cuda.syncthreads()
        for e in range(tid, G * d, TPB):                  # merged into warp 0's rows: each (g, i) is this
            g = e // d                                    # thread's alone
            i = e - g * d
            mm = NEG_INF
            for u in range(NW):
                mm = max(mm, smem[OFF_ML + 2 * (u * G + g)])
            o = f0
            ll = f0
            for u in range(NW):
                mu = smem[OFF_ML + 2 * (u * G + g)]
                if mu != NEG_INF:
                    f = math.exp(mu - mm)
                    o += smem[OFF_T + (u * G + g) * d + i] * f
                    ll += smem[OFF_ML + 2 * (u * G + g) + 1] * f
            smem[OFF_T + g * d + i] = o
            if i == 0:
                part_ml[split, hk * G + g, 0] = mm * float32(LOG2E)
                part_ml[split, hk * G + g, 1] = ll
        cuda.syncthreads()
        for g in range(w, G, NW):                         # the values' rotation back, per split, by warps
            for k in range(V):
                rot[k] = smem[OFF_T + g * d + V * lane + k]
            warp_fwht(rot, V, lane)
            for k in range(V):
                i = V * lane + k
                part_o[split, hk * G + g, i] = rot[k] * v_signs[i] * INV_SQRT_D

    return partial, split_combine_kernel(d, n_splits, STEP, gated)


class KvqDecodeWorkspace:
    """Split-K partials for H heads of size d."""

    def __init__(self, H: int, d: int, n_splits: int, stream=0) -> None:
        self.n_splits = n_splits
        self.part_o = cuda.to_device(np.zeros((n_splits, H, d), np.float32), stream=stream)    # [S, H, d]
        self.part_ml = cuda.to_device(np.zeros((n_splits, H, 2), np.float32), stream=stream)   # [S, H, 2]
        self.no_gate = cuda.to_device(np.zeros((1, 1), np.float32), stream=stream)  # proj's stand-in, ungated


def kvq_attention_decode(q, k_codes, k_norms, v_codes, v_norms, kv_len, k_tables: KvqTables,
                         v_tables: KvqTables, out, ws: KvqDecodeWorkspace, stream=0, proj=None,
                         kernels: tuple[str, ...] = ("partial", "combine")) -> None:
    """out [H, d] = attention of this token's q [H, d] over the first kv_len[0] cached tokens (module
    docstring for the layouts); k_tables / v_tables: the roles' rotation signs and codebooks. With proj
    ([1, P], the layer's fused projection row) the output gate is applied and out is [H·d], as
    flash_attn.decode.attention_decode writes it. ``kernels``: which of the two to launch (the benchmark
    times each alone; the model launches both)."""
    H, d = q.shape
    Hkv = k_codes.shape[0]
    gated = proj is not None
    partial, combine = _kernels(H, Hkv, d, k_tables.bits, v_tables.bits, ws.n_splits, gated)
    nbytes = 4 * partial_smem_words(H // Hkv, d, k_tables.bits, v_tables.bits)[-1]
    if "partial" in kernels:
        partial[(ws.n_splits, Hkv), TPB, stream, nbytes](
            q, _words(k_codes), k_norms, _words(v_codes), v_norms, kv_len, k_tables.signs, k_tables.levels,
            v_tables.levels, v_tables.signs, ws.part_o, ws.part_ml)
    if "combine" in kernels:                  # the f16 cache's combine, for a batch of one row
        combine[(H, (d + 31) // 32, 1), COMB_TPB, stream](ws.part_o.reshape((1,) + ws.part_o.shape),
                                                          ws.part_ml.reshape((1,) + ws.part_ml.shape), kv_len,
                                                          proj if gated else ws.no_gate, out.reshape(1, out.size))


def _words(codes):
    """A coded cache [Hkv, max_seq, row bytes] as one flat run of uint32 words (rows are whole words)."""
    return codes.reshape(codes.size).view(np.uint32)
