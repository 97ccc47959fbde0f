"""Decode attention over the coded KV cache (3, 4 or 8 bits), in the rotated domain (kvq/ref.py's
attention_rotated_ref for one query token): no cached vector is ever rotated back.

Split-K over the cached tokens, two kernels on one stream:
  partial  grid (n_splits, Hkv), NW warps: one block serves the G query heads of its KV head, so each coded
           row is read and unpacked once for all of them. A split is a whole number of STEP = CH·NW keys
           (split_range_len); the splits past kv_len return at once. The warps rotate the G queries by the
           keys' rotation (signs, Walsh-Hadamard butterflies in registers and by shuffles); then every lane
           keeps, in registers, the rotated queries at the 8 coordinates it owns: lane l owns coordinates
           8l .. 8l + 7, which are code group l of every key and value row (one 24-bit group at 3 bits, one
           word at 4, two at 8). Each warp takes chunks of CH consecutive tokens (chunks w, w + NW, ...):
             loads    per token the one or two words holding my group, straight from global memory into
                      registers (a warp's load of one row is 96 or 128 contiguous bytes); no shared staging
             scores   per token and head, my 8 coordinates' share of q_rot · level[c] (levels from an 8-,
                      16- or 256-entry table in shared memory); the 32 lanes' shares are summed by a butterfly
                      that scatters the CH tokens over the lanes (log2 CH halving steps, then plain steps), so
                      lane l ends with the G full scores of token l >> (5 - log2 CH) at ~1 shuffle per score
             softmax  per head, online across the warp's chunks (max and sum by shuffles over the token
                      bits of the lane; the accumulator is rescaled only when the maximum grows)
             values   for each token of the chunk, its G weights p · n_v / sqrt(d) by shuffle from the
                      token's lanes, then 8 levels × G FMAs into my coordinates' accumulators
           The warps' (max, sum, accumulator) are merged in shared memory into the split's partial, which
           the warps rotate back by the values' rotation (linear, so the rotation of each split's partial
           sums to the rotation of the merged output) and written with its maximum in the log2 domain.
  combine  flash_attn/split_combine.py's, the f16 cache's: the splits merged, divided by the softmax sum,
           gated. (Rotating back once per head after the merge took a block per head walking every split's
           maximum and sum, then the partials in dependent steps: ~17 µs per call at any depth.)
The output is the attention of the head before the model's output gate, as flash_attn.decode's partials
are before theirs.

Why this shape (issue 14): the kernel reads ~196 B per (token, KV head) at k3v3 and is bound by the
instructions per code, not by bytes. The previous partial copied each 32-token tile to shared memory, gave a
lane a whole token and read the G rotated queries from shared memory for every code (G + 1 shared loads per
key code); here the queries sit in registers and a code costs one table load, its extraction and G FMAs.

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

from ninfer_numba.kernels.dynamic_smem import allow_dynamic_smem
from ninfer_numba.kernels.flash_attn.decode import LOG2E, h2_to_f32
from ninfer_numba.kernels.flash_attn.split_combine import COMB_TPB, split_combine_kernel, split_range_len
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.ptx import shfl_idx_f32, shfl_xor_f32

# EngineConfig.kvq_partial "auto": k3v3 on tensor cores (decode_mma.py) at any capacity (H200, 9B, session
# 22: 315.0 t/s at depth 32K against 309.8 tokens and 308.7 lanes; bench_attn partial at 8K 21.9 µs against
# 28.2 / 22.8); other 3/4-bit caches the token-lane partial from this capacity on (bench_attn session 19:
# tokens 32.5 / 50.2 µs at 8K / 32K against lanes 28.4 / 61.2), else lanes
TOKENS_FROM = 16384
MMA_MAX_GROUP = 8           # query heads per KV head the mma partial takes (the columns of one mma)
MMA_TILE = 16               # cache rows the mma partial copies at once (its rows: multiples of it)
NW = 4                      # warps per partial block
TPB = 32 * NW
NEG_INF = float32(-np.inf)


def chunk_tokens(G: int) -> int:
    """Tokens a warp scores at once: the largest power of two <= 8 with CH·G <= 16, so the CH·G partial
    scores of a chunk fit in registers beside the 8·G queries and the 8·G accumulators of a lane (at G = 4:
    32 + 32 + 16 of the 128 registers the occupancy target allows)."""
    ch = 8
    while ch > 1 and ch * G > 16:
        ch //= 2
    return ch


@cuda.jit(device=True, inline=True)
def funnel(hi, lo, sh):
    """Bits sh.. of the 64-bit word hi:lo as uint32 (sh < 64; one SHF.R.U64 in the partials' sm_90a SASS): a
    code group that straddles two words of a coded row. The three partials read their groups through it."""
    return uint32(((uint64(hi) << uint64(32)) | uint64(lo)) >> uint64(sh))


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


@cuda.jit(device=True, inline=True)
def rotate_query(q, row, signs, rot, V, lane):
    """rot[0:V] = this lane's coordinates V·lane .. V·lane + V - 1 of query row ``row`` times the keys' signs,
    Walsh-Hadamard transformed across the warp: the query in the rotated domain the codes live in (the
    transform unnormalised: both partials' score factors account for it)."""
    for k in range(V):
        i = V * lane + k
        rot[k] = float32(q[row, i]) * signs[i]
    warp_fwht(rot, V, lane)


def partial_smem_words(G: int, d: int) -> tuple[int, ...]:
    """(offsets of the rotated queries, warp maxima and sums, warp accumulators; total words) of the partial
    kernel's dynamic shared memory (the codebooks are a static array). The queries [G, d] are read once into
    registers; the warps' accumulators [NW, G, d] are written after the main loop for the merge."""
    off_q = 0
    off_ml = off_q + G * d
    off_a = off_ml + 2 * NW * G
    return off_q, off_ml, off_a, off_a + NW * G * d


@lru_cache(maxsize=None)
def block_place(n_splits: int, step: int):
    """place(kv_len, k_norms) -> (split, KV head, thread, warp, lane, max_seq, cached tokens, keys per split)
    of a partial block (grid (n_splits, Hkv), TPB threads; splits are whole multiples of ``step`` keys), the
    same for every partial."""
    @cuda.jit(device=True, inline=True)
    def place(kv_len, k_norms):
        tid = cuda.threadIdx.x
        n_kv = kv_len[0]
        return (cuda.blockIdx.x, cuda.blockIdx.y, tid, tid >> 5, tid & 31, k_norms.shape[1], n_kv,
                split_range_len(n_kv, n_splits, step))
    return place


@cuda.jit(device=True, inline=True)
def raise_max(m, lsum, acc, g, mx):
    """Online softmax (log2 domain) of head g: where a tile's maximum mx exceeds the running one m[g], the
    running sum lsum[g] and the head's 8 value accumulators acc[8g..8g+7] rescale to it."""
    if mx > m[g]:
        alpha = math.exp2(m[g] - mx)
        lsum[g] *= alpha
        for k in range(8):
            acc[8 * g + k] *= alpha
        m[g] = mx


@lru_cache(maxsize=None)
def split_rotate_out(G: int, d: int, OFF_A: int):
    """rotate_out(smem, rot, lane, w, split, hk, part_o, v_signs): the split's value sums [G, d] at OFF_A in
    shared memory (a barrier first) rotated back by warps (warp_fwht, the values' signs, 1/sqrt(d)) into
    part_o. The end of every partial: after split_merge's merge of the warps' slots, or directly where the
    warps' outputs are disjoint coordinates of one softmax (decode_mma.py)."""
    V = d // 32                  # coordinates of a row per lane in the warp-held rotations
    INV_SQRT_D = float32(1.0 / math.sqrt(d))

    @cuda.jit(device=True, inline=True)
    def rotate_out(smem, rot, lane, w, split, hk, part_o, v_signs):
        for g in range(w, G, NW):                         # the values' rotation back, per split, by warps
            for k in range(V):
                rot[k] = smem[OFF_A + g * d + V * lane + k]
            warp_fwht(rot, V, lane)
            for k in range(V):
                i = V * lane + k
                part_o[split, hk * G + g, i] = rot[k] * v_signs[i] * INV_SQRT_D
    return rotate_out


@lru_cache(maxsize=None)
def split_merge(G: int, d: int, OFF_A: int, OFF_ML: int):
    """The end of a partial block once each warp has put its value accumulators [G, d] at OFF_A + (w·G +
    g)·d and its (max, sum) per head at OFF_ML + 2·(w·G + g) in shared memory (a barrier first): merged into
    warp 0's rows, the split's (max, sum) written, then split_rotate_out. Shared by the lanes and token-lane
    partials (decode.py, decode_tokens.py)."""
    f0 = float32(0.0)
    rotate_out = split_rotate_out(G, d, OFF_A)

    @cuda.jit(device=True, inline=True)
    def merge(smem, rot, lane, w, tid, split, hk, part_o, part_ml, v_signs):
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
                    f = math.exp2(mu - mm)
                    o += smem[OFF_A + (u * G + g) * d + i] * f
                    ll += smem[OFF_ML + 2 * (u * G + g) + 1] * f
            smem[OFF_A + g * d + i] = o
            if i == 0:
                part_ml[split, hk * G + g, 0] = mm
                part_ml[split, hk * G + g, 1] = ll
        cuda.syncthreads()
        rotate_out(smem, rot, lane, w, split, hk, part_o, v_signs)
    return merge


@lru_cache(maxsize=None)
def split_tail(G: int, d: int, OFF_A: int, OFF_ML: int):
    """split_merge after the stores of the lanes' layout (this partial and decode_tokens.py): lane l < d/8
    holds coordinates 8l .. 8l + 7 of every head in acc[8g + k]; every lane holds the heads' (max, sum)."""
    LANES = d // 8               # lanes owning a code group (8 coordinates) of every row
    merge = split_merge(G, d, OFF_A, OFF_ML)

    @cuda.jit(device=True, inline=True)
    def tail(smem, acc, m, lsum, rot, lane, w, tid, split, hk, part_o, part_ml, v_signs):
        if lane < LANES:
            for g in range(G):
                for k in range(8):
                    smem[OFF_A + (w * G + g) * d + 8 * lane + k] = acc[8 * g + k]
        if lane == 0:
            for g in range(G):
                smem[OFF_ML + 2 * (w * G + g)] = m[g]
                smem[OFF_ML + 2 * (w * G + g) + 1] = lsum[g]
        merge(smem, rot, lane, w, tid, split, hk, part_o, part_ml, v_signs)
    return tail


@lru_cache(maxsize=None)
def _kernels(H: int, Hkv: int, d: int, k_bits: int, v_bits: int, n_splits: int, gated: bool = False):
    if d % 32 or d > 256 or d & (d - 1) or H % Hkv or not {k_bits, v_bits} <= {3, 4, 8}:
        raise ValueError(f"unsupported kvq decode: H={H}, Hkv={Hkv}, d={d} (a power of two, 32 <= d <= 256), "
                         f"k{k_bits}v{v_bits} (3, 4 or 8 bits)")
    G = H // Hkv
    V = d // 32                  # coordinates of a row per lane in the warp-held rotations
    LANES = d // 8               # lanes owning a code group (8 coordinates) of every row
    R8 = 8 * G                   # a lane's query / accumulator registers [head, coordinate 8·lane + k]
    CH = chunk_tokens(G)
    LG = CH.bit_length() - 1     # log2 CH: the butterfly's token-scattering steps
    TSH = 5 - LG                 # after them, lane l holds the scores of chunk token l >> TSH
    PS = CH * G                  # a lane's partial scores [token, head]
    STEP = CH * NW               # a split's keys are whole multiples of this: every warp has a chunk
    WK = d * k_bits // 32        # words of a coded key row
    WV = d * v_bits // 32
    OFF_Q, OFF_ML, OFF_A, _ = partial_smem_words(G, d)
    INV_SQRT_D = float32(1.0 / math.sqrt(d))
    SCORE = float32(LOG2E / d ** 1.5)           # scores in the log2 domain: p = 2^(s - m)
    # a lane's code group: 24 or 32 bits in a uint32, 64 (8 bits) in a uint64, extracted in that width
    KW = uint64 if k_bits == 8 else uint32
    VW = uint64 if v_bits == 8 else uint32
    KMASK = KW((1 << k_bits) - 1)
    VMASK = VW((1 << v_bits) - 1)
    LV = 256 if 8 in (k_bits, v_bits) else 16    # codebook entries per role in the shared table
    LV2 = 2 * LV                                 # (shared array shapes must be plain constants)
    f0 = float32(0.0)
    tail = split_tail(G, d, OFF_A, OFF_ML)
    place = block_place(n_splits, STEP)
    # 4 blocks (16 warps) per SM: 512 blocks of the 9B's 4 KV heads x 128 splits in one wave
    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 4)}

    @cuda.jit(device=True, inline=True)
    def group_bits(words, row, W, bits, grp):
        """The 8·bits code bits of group grp of coded row ``row`` (words of W per row), low code first. At 3
        bits group g is bits 24g .. 24g + 23: in word 3g/4 alone when 24g % 32 <= 8, else across it and the
        next one (clamped inside the row: that word is then unused, and the last row has no word after)."""
        base = row * uint32(W)
        if bits == 4:
            return words[base + grp]
        wa = (uint32(3) * grp) >> uint32(2)
        wb = min(wa + uint32(1), uint32(W - 1))
        return funnel(words[base + wb], words[base + wa], (uint32(24) * grp) & uint32(31))

    @cuda.jit(device=True, inline=True)
    def group_bytes(words, row, W, grp):
        """The 64 code bits of group grp of an 8-bit coded row: words 2·grp and 2·grp + 1."""
        base = row * uint32(W) + uint32(2) * grp
        return (uint64(words[base + uint32(1)]) << uint64(32)) | uint64(words[base])

    def role_group(bits: int, W: int):
        """group(words, row, grp): my code group of one role's row, in that role's width."""
        if bits == 8:
            def group(words, row, grp):
                return group_bytes(words, row, W, grp)
        else:
            def group(words, row, grp):
                return group_bits(words, row, W, bits, grp)
        return cuda.jit(device=True, inline=True)(group)
    k_group, v_group = role_group(k_bits, WK), role_group(v_bits, WV)

    @cached_jit(pdl=True, **occupancy)
    def partial(q, k_words, k_norms, v_words, v_norms, kv_len, k_signs, k_levels, v_levels, v_signs, part_o,
                part_ml, k_flat, v_flat):
        # k_words [Hkv·max_seq·WK], v_words [Hkv·max_seq·WV] uint32 (flat views of the coded caches);
        # k_flat, v_flat [Hkv·max_seq] uint16: the norms flat (k_norms gives max_seq)
        griddep_wait()                                    # kernels/pdl.py: before any global access
        griddep_launch_dependents()                       # the combine may be scheduled; it waits for us
        smem = cuda.shared.array(0, float32)
        # the codebooks (keys at 0, values at LV) in a static array: its address is a link-time constant,
        # so a code's table load is one LDS with an immediate offset (the dynamic array's base is a register)
        s_lvl = cuda.shared.array(LV2, float32)
        split, hk, tid, w, lane, max_seq, n_kv, per = place(kv_len, k_norms)
        if split * per >= n_kv:
            return                                        # past kv_len: the combine reads no such split
        rot = cuda.local.array(V, float32)                # a row's coordinates V·lane.. in a warp rotation
        for g in range(w, G, NW):                         # s_q [G, d]: the queries · signs, rotated by warps
            rotate_query(q, hk * G + g, k_signs, rot, V, lane)
            for k in range(V):
                smem[OFF_Q + g * d + V * lane + k] = rot[k]
        if LV == 16:
            if tid < 16:
                s_lvl[tid] = k_levels[tid] if tid < k_levels.shape[0] else f0
                s_lvl[16 + tid] = v_levels[tid] if tid < v_levels.shape[0] else f0
        else:
            for i in range(tid, LV, TPB):
                s_lvl[i] = k_levels[i] if i < k_levels.shape[0] else f0
                s_lvl[LV + i] = v_levels[i] if i < v_levels.shape[0] else f0
        cuda.syncthreads()
        # my code group; lanes past LANES (d < 256) mirror the last group with zero queries, so they add
        # nothing to the scores, and their accumulators are never written
        grp = uint32(min(lane, LANES - 1))
        r_q = cuda.local.array(R8, float32)               # [G, 8] rotated queries at my coordinates
        for g in range(G):
            for k in range(8):
                r_q[8 * g + k] = smem[OFF_Q + g * d + 8 * grp + k] if lane < LANES else f0
        m = cuda.local.array(G, float32)                  # running maximum (log2 domain), same in all lanes
        lsum = cuda.local.array(G, float32)
        acc = cuda.local.array(R8, float32)               # [G, 8] unnormalised output at my coordinates
        part = cuda.local.array(PS, float32)              # [CH, G] my share of the chunk's scores
        v_bits_t = cuda.local.array(CH, VW)               # the chunk's value code groups (mine)
        pv = cuda.local.array(G, float32)                 # weights p · n_v / sqrt(d) of my chunk token
        lv = cuda.local.array(8, float32)                 # a value row's levels at my coordinates
        for g in range(G):
            m[g] = NEG_INF
            lsum[g] = f0
        for x in range(R8):
            acc[x] = f0
        j_end = min(n_kv, (split + 1) * per)
        # row arithmetic in uint32 (rows < Hkv·max_seq < 2^32): int64 indices cost a 64-bit add chain and
        # a clamp in two halves per load
        row0 = uint32(hk * max_seq)
        last = row0 + uint32(j_end - 1)
        t_mine = lane >> TSH
        for c0 in range(split * per + CH * w, j_end, CH * NW):    # warp-uniform
            r_c = row0 + uint32(c0)
            # tokens past j_end (the split's last chunk) load the last row and are masked below
            for t in range(CH):
                row = min(r_c + uint32(t), last)
                kb = k_group(k_words, row, grp)
                v_bits_t[t] = v_group(v_words, row, grp)
                for g in range(G):
                    part[t * G + g] = f0
                for k in range(8):
                    lvl = s_lvl[(kb >> KW(k_bits * k)) & KMASK]
                    for g in range(G):
                        part[t * G + g] += r_q[8 * g + k] * lvl
            tok = min(r_c + uint32(t_mine), last)
            kn, _ = h2_to_f32(uint32(k_flat[tok]))
            vn, _ = h2_to_f32(uint32(v_flat[tok]))
            # butterfly over the 32 lanes' shares: step s pairs token slots j and j + n/2 of lanes 16 >> s
            # apart, each lane keeping the half its lane bit selects (the slot order follows the bit)
            n = CH
            mask = 16
            for _ in range(LG):
                n //= 2
                upper = lane & mask != 0
                for j in range(n):
                    for g in range(G):
                        lo = part[j * G + g]
                        hi = part[(j + n) * G + g]
                        part[j * G + g] = (hi if upper else lo) + shfl_xor_f32(lo if upper else hi, mask)
                mask >>= 1
            while mask > 0:                               # the lanes of one token: plain sums
                for g in range(G):
                    part[g] += shfl_xor_f32(part[g], mask)
                mask >>= 1
            valid = c0 + t_mine < j_end
            for g in range(G):                            # online softmax of head g over this chunk
                score = part[g] * kn * SCORE if valid else NEG_INF
                mx = score
                mk = 16
                for _ in range(LG):
                    mx = max(mx, shfl_xor_f32(mx, mk))
                    mk >>= 1
                raise_max(m, lsum, acc, g, mx)            # warp-uniform: every lane holds the same maxima
                p = math.exp2(score - m[g])
                ps = p
                mk = 16
                for _ in range(LG):
                    ps += shfl_xor_f32(ps, mk)
                    mk >>= 1
                lsum[g] += ps
                pv[g] = p * vn * INV_SQRT_D if valid else f0    # p is 0 there: keep a stray NaN norm out
            for t in range(CH):
                bits = v_bits_t[t]
                for k in range(8):
                    lv[k] = s_lvl[uint32(LV) + ((bits >> VW(v_bits * k)) & VMASK)]
                for g in range(G):
                    pr = shfl_idx_f32(pv[g], t << TSH)
                    for k in range(8):
                        acc[8 * g + k] += pr * lv[k]
        tail(smem, acc, m, lsum, rot, lane, w, tid, split, hk, part_o, part_ml, v_signs)

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
                         kernels: tuple[str, ...] = ("partial", "combine"), variant: str = "lanes") -> None:
    """out [H, d] = attention of this token's q [H, d] over the first kv_len[0] cached tokens (module
    docstring for the layouts); k_tables / v_tables: the roles' rotation signs and codebooks. With proj
    ([1, P], the layer's fused projection row) the output gate is applied and out is [H·d], as
    flash_attn.decode.attention_decode writes it. ``kernels``: which of the two to launch (the benchmark
    times each alone; the model launches both). ``variant``: "lanes" (this module's partial) or "tokens"
    (kvq/decode_tokens.py's, a lane per key token) or "mma" (kvq/decode_mma.py's, on tensor cores), so one
    process can time each."""
    if variant not in ("lanes", "tokens", "mma"):
        raise ValueError(f"unknown kvq decode variant {variant!r} (lanes, tokens, mma)")
    H, d = q.shape
    Hkv = k_codes.shape[0]
    gated = proj is not None
    shape = (H, Hkv, d, k_tables.bits, v_tables.bits, ws.n_splits, gated)
    if variant == "lanes":
        (partial, combine), nbytes = _kernels(*shape), 4 * partial_smem_words(H // Hkv, d)[-1]
    elif variant == "tokens":
        from ninfer_numba.kernels.kvq import decode_tokens                 # it imports this module's helpers
        (partial, combine), nbytes = decode_tokens._kernels(*shape), 4 * decode_tokens.smem_words(H // Hkv, d)[-1]
    else:
        from ninfer_numba.kernels.kvq import decode_mma
        if k_codes.shape[1] % decode_mma.TILE:
            raise ValueError(f"the mma partial copies whole tiles of {decode_mma.TILE} cache rows: a cache of "
                             f"{k_codes.shape[1]} rows is not (engine/cache.py allocates multiples)")
        (partial, combine) = decode_mma._kernels(*shape)
        nbytes = 4 * decode_mma.smem_words(H // Hkv, d, k_tables.bits, v_tables.bits)[-1]
    if "partial" in kernels:
        args = (q, _words(k_codes), k_norms, _words(v_codes), v_norms, kv_len, k_tables.signs, k_tables.levels,
                v_tables.levels, v_tables.signs, ws.part_o, ws.part_ml, k_norms.reshape(k_norms.size),
                v_norms.reshape(v_norms.size))
        allow_dynamic_smem(partial, args, nbytes)     # the mma partial's lane-wide tables pass 48 KiB
        partial[(ws.n_splits, Hkv), TPB, stream, nbytes](*args)
    if "combine" in kernels:                  # the f16 cache's combine, for a batch of one row
        combine[(H, (d + 31) // 32, 1), COMB_TPB, stream](ws.part_o.reshape((1,) + ws.part_o.shape),
                                                          ws.part_ml.reshape((1,) + ws.part_ml.shape), kv_len,
                                                          proj if gated else ws.no_gate, out.reshape(1, out.size))


def mma_rows(rows: int) -> int:
    """``rows`` rounded up to whole tiles of the mma partial: the rows a coded cache is allocated with."""
    return -(-rows // MMA_TILE) * MMA_TILE


def pick_partial(choice: str, k_bits: int, v_bits: int, capacity: int, group: int = 1) -> str:
    """The partial kvq_attention_decode runs for EngineConfig.kvq_partial ``choice`` on a cache of
    ``capacity`` rows with ``group`` query heads per KV head: "auto" takes mma for k3v3 (up to
    MMA_MAX_GROUP heads, rows a multiple of its tile), tokens from TOKENS_FROM on where it decodes the bits,
    else lanes."""
    if choice != "auto":
        return choice
    if k_bits == v_bits == 3 and group <= MMA_MAX_GROUP and capacity % MMA_TILE == 0:
        return "mma"
    return "tokens" if capacity >= TOKENS_FROM and max(k_bits, v_bits) <= 4 else "lanes"


def _words(codes):
    """A coded cache [Hkv, max_seq, row bytes] as one flat run of uint32 words (rows are whole words)."""
    return codes.reshape(codes.size).view(np.uint32)
