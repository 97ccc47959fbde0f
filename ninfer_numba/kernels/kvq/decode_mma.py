"""Decode attention over the 3/4-bit KV cache, third partial kernel: scores and values on tensor cores.

Same inputs, outputs, split-K contract, merge (decode.split_merge) and combine as kvq/decode.py (read its
docstring first); only the partial's main loop differs. decode.py and decode_tokens.py spend ~230 and ~148
SASS instructions per (token, KV head) on FMAs against codebook values (4 per code at G = 4) and their
table loads; here each code becomes one half of an f16 pair and the products run as mma.m16n8k16 (fp16
operands, fp32 accumulators: kernels/flash_attn/mma_f16.py's fragment layouts). The block walks its split in
tiles of 16 consecutive tokens; its NW warps split the coordinates (warp w: 64 of d = 256, chunks of 32
codes), so every warp sees every tile; lane (r, t) = (lane >> 2, lane & 3):

  keys    S [16 tokens × 8 heads] = K · Q^T over my warp's coordinates (4 k-steps at d = 256), one mma per
          k-step. B is the rotated queries, head r in column r (columns >= G zero), fixed for the block:
          packed once in fragment order (s_qf) and held in registers. A's rows are the tile's tokens: lane
          (r, t) holds coordinates 16s + 2t, +1 and 16s + 8 + 2t, +1 of the key rows of tokens r and 8 + r,
          i.e. one pair of adjacent codes from each 8-code group (bits 6t.. of a 24-bit group, byte t of a
          4-bit word), each looked up as a ready f16 pair in a table of the 64 (256) pairs. Every A row is a
          token, so no operand register is padding. The warps' shares of S meet in shared memory (s_s,
          double-buffered: one barrier a tile), written [head][token] in the order the softmax reads them.
  softmax lane (r, t) reads head r's scores of tokens 2t, 2t + 1, 8 + 2t, 9 + 2t (one 16-byte load a share):
          every warp sums the shares in the same order and runs the same online softmax (maximum and sum per
          head by two shuffles over t), so all hold the same maximum and weights; p · n_v / sqrt(d) packs
          straight into the B fragment of the values' product (FlashAttention-2's register reuse). A grown
          maximum rescales O where any head's grew (vote), the two heads' factors a lane's outputs need
          fetched by two shuffles.
  values  O^T [16 coordinates × 8 heads] += V^T [16 × 16 tokens] · P^T for my warp's 4 tiles of 16
          coordinates. A's rows are coordinates 16b + r and 16b + 8 + r: lane (r, t) takes code r of two
          groups of the value rows of tokens 2t, 2t + 1 (and 8 + 2t, 9 + 2t) and looks each two tokens' codes
          up as one f16 pair (the reduction runs over tokens); O[heads 2t, 2t + 1] at those coordinates stay
          in registers (heads >= G are padding).
  end     each warp's coordinates and the common (max, sum) go to split_merge's first slot (the others
          empty), which rotates the split's output back as for the other partials.

Loads run ahead of their use: the next tile's key rows and norms are read after this tile's scores, a
tile's value rows before its scores, the first tile's all before the prologue (ptx.py's *_ahead loads,
which LLVM leaves where written). Without that the 9B step at depth 32K spent ~53 µs more between kernels
than with the f16 cache: alone, the partial's 26 MB of codes sit in L2; in the step they come from DRAM
(H200, session 22).

Offline sm_90a (9B shape): 117 (k3v3), 115 (k4v3), 121 (k4v4) registers, no local memory, 458 SASS in the
main loop at k3v3 (8 mma a warp a tile; 611 before the three changes of session 22 named in its notes).
Heads as the rows of A (queries fixed, rows >= G zero) took 16 mma and 42 register moves a tile: ptxas
rebuilt the zero halves of the A operands before every mma. 3 and 4 bits only, up to 8 query heads per KV
head (the columns of one mma).

Buffers as decode.py; shared memory: s_q [G, d] f32 (rotated queries) | s_s [2, NW, 8, 16] | s_ml [NW, G, 2]
| s_a [NW, G, d] (dynamic), plus static s_qf [d/16, 32, 2] u32 and the key and value pair tables [256] u32.
"""
from __future__ import annotations

from functools import lru_cache

import math

from numba import float32, int64, uint32

from ninfer_numba.kernels.flash_attn.decode import LOG2E, h2_to_f32
from ninfer_numba.kernels.flash_attn.mma_f16 import mma_f16_16816, pack_f16x2
from ninfer_numba.kernels.flash_attn.split_combine import split_combine_kernel
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.decode import (MMA_MAX_GROUP, NEG_INF, NW, TPB, block_place, funnel,
                                             pair_table_filler, rotate_query, split_merge)
from ninfer_numba.kernels.kvq.decode_tokens import lds_u32
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, device_inline
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.ptx import (ldg_nc_u16_ahead, ldg_nc_v2_u32_ahead, ldg_nc_v4_u32_ahead, shfl_idx_f32,
                                      shfl_xor_f32, vote_any)
from ninfer_numba.kernels.ptx_sm90 import ld_shared_v4_f32, smem_u32

TILE = 16                   # tokens per tile: the k dimension of the values' mma
STEP = TILE                 # a split's keys are whole tiles (every warp walks every tile)
MAX_G = MMA_MAX_GROUP       # query heads per KV head: the B columns of one mma that are not padding


def warp_coordinates(d: int) -> int:
    """Coordinates of the keys' reduction and of the output each warp takes: a quarter of d, at least one
    chunk of 32 (at d < 128 the warps past d / 32 only follow the softmax)."""
    return max(32, d // NW)


SHARE = NW * 8 * 16 + 32     # words of one s_s buffer: the warps' score shares, then the tile's 32 norms


def smem_words(G: int, d: int) -> tuple[int, ...]:
    """(offsets of s_q, s_s, s_ml, s_a; total words) of the partial's dynamic shared memory; s_s [2, SHARE]
    holds each warp's share of a tile's scores [NW, 8 heads, 16 tokens] and the tile's key and value norms
    [2, 16], double-buffered (one barrier per tile)."""
    off_q = 0
    off_s = off_q + G * d
    off_ml = off_s + 2 * SHARE
    off_a = off_ml + 2 * NW * G
    return off_q, off_s, off_ml, off_a, off_a + NW * G * d


@lru_cache(maxsize=None)
def _kernels(H: int, Hkv: int, d: int, k_bits: int, v_bits: int, n_splits: int, gated: bool = False):
    if d % 32 or d > 256 or d & (d - 1) or H % Hkv or H // Hkv > MAX_G:
        raise ValueError(f"unsupported kvq decode: H={H}, Hkv={Hkv}, d={d} (a power of two, 32 <= d <= 256, "
                         f"at most {MAX_G} query heads per KV head for the mma partial)")
    if not {k_bits, v_bits} <= {3, 4}:
        raise ValueError(f"the mma partial decodes 3- and 4-bit codes, not k{k_bits}v{v_bits} "
                         "(variant='lanes' decodes 8-bit ones)")
    G = H // Hkv
    V = d // 32                  # coordinates of a row per lane in the warp-held rotations
    CPW = warp_coordinates(d)    # a warp's coordinates: CPW / 32 chunks of 32
    NWD = d // CPW               # warps with coordinates
    NCW = CPW // 32              # chunks per warp: 2 k-steps of keys, 4 output tiles of values each
    NO = 4 * (CPW // 16)         # a lane's output registers: 4 per 16-coordinate tile
    QA = 4 * NCW                 # a lane's query fragment registers: 2 per k-step of its warp
    KN = 4 if k_bits == 4 else 3  # words per chunk of a key row
    VN = 4 if v_bits == 4 else 3
    XK = KN * NCW                # words of my chunks of one key row
    XV = VN * NCW                # and of one value row
    XK2, XV4 = 2 * XK, 4 * XV    # a lane's words of one tile: two key rows, four value rows
    # the first tile's value rows load before the prologue too at 3 bits; at 4 bits their 32 words beside the
    # prologue's registers spill (ptxas sm_90a, 128 registers)
    EARLY_V = v_bits == 3
    # 3-bit runs as 8-byte loads: my 3·NCW words start at word 3·NCW·w of a row of 3·d/32 words
    V2 = NCW % 2 == 0 and (3 * d // 32) % 2 == 0
    QF = 2 * (d // 16) * 32      # s_qf words
    WK = d * k_bits // 32        # words of a coded key row
    WV = d * v_bits // 32
    # a looked-up field is placed at its table offset's bits (4 bytes an entry: from bit 2) as it is extracted,
    # so that one LOP3 masks it and ORs the table's base in
    KP4 = uint32(((1 << (2 * k_bits)) - 1) << 2)          # a key pair's table byte offset
    V4 = uint32(((1 << v_bits) - 1) << 2)                 # the first token's code in a value pair's offset
    V4B = uint32(((1 << v_bits) - 1) << (2 + v_bits))     # the second token's
    OFF_Q, OFF_S, OFF_ML, OFF_A, _ = smem_words(G, d)
    INV_SQRT_D = float32(1.0 / math.sqrt(d))
    SCORE = float32(LOG2E / d ** 1.5)
    f0 = float32(0.0)
    z = uint32(0)
    merge = split_merge(G, d, OFF_A, OFF_ML)
    place = block_place(n_splits, STEP)
    fill_k, fill_v = pair_table_filler(k_bits), pair_table_filler(v_bits)
    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 4)}

    @device_inline
    def load_chunks(words, at, bits, x, o):
        """x[o:o + NCW·n] = my warp's NCW chunks (n = 3 or 4 words each) of a row from flat word ``at``: 16-byte
        loads at 4 bits, 8-byte ones at 3 bits where the run is whole pairs of aligned words; issued here, a
        tile before their use (ptx.py's *_ahead loads). ``at`` is an int64: each load's constant offset then
        folds into the instruction's immediate (sm_90a: [R.64 + 0x8]); from a uint32 index every load
        widened and shifted its own address, ~8 instructions each, 96 of the loop's 587."""
        if bits == 4:
            for u in range(NCW):
                x[o + 4 * u], x[o + 4 * u + 1], x[o + 4 * u + 2], x[o + 4 * u + 3] = ldg_nc_v4_u32_ahead(
                    words, at + 4 * u)
        elif V2:
            for u in range(3 * NCW // 2):
                x[o + 2 * u], x[o + 2 * u + 1] = ldg_nc_v2_u32_ahead(words, at + 2 * u)
        else:
            for u in range(3 * NCW):
                x[o + u] = words[at + u]

    @device_inline
    def tile_norm(k_flat, v_flat, r_c, lane, last):
        """The norm of token lane & 15 of the tile at row r_c (past the split: the last row's), a key's in
        lanes < 16, a value's above; issued here, a tile before its use."""
        tok = min(uint32(r_c + uint32(lane & 15)), last)
        bits = ldg_nc_u16_ahead(k_flat, tok) if lane < 16 else ldg_nc_u16_ahead(v_flat, tok)
        nrm, _ = h2_to_f32(uint32(bits))
        return nrm

    @device_inline
    def group_field(x, o, j, bits, sh, pre):
        """Bits sh.. (sh + a field < 24 or 32) of code group j (of 4 per chunk) of the chunk's words at x[o:],
        moved to bit pre (<= 5; the caller masks): a 24-bit group is at bit 24j of the chunk's three words, a
        4-bit group is word j. At 3 bits the move is part of the shift or funnel (one instruction for groups
        1-3; group 0's 24 bits leave room to shift left first)."""
        if bits == 4:
            return (x[o + j] >> sh) << uint32(pre)
        if j == 0:
            return (x[o] << uint32(pre)) >> sh
        if j == 1:
            return funnel(x[o + 1], x[o], uint32(24 - pre) + sh)
        if j == 2:
            return funnel(x[o + 2], x[o + 1], uint32(16 - pre) + sh)
        return x[o + 2] >> (uint32(8 - pre) + sh)

    @cached_jit(pdl=True, **occupancy)
    def partial(q, k_words, k_norms, v_words, v_norms, kv_len, k_signs, k_levels, v_levels, v_signs, part_o,
                part_ml, k_flat, v_flat):
        griddep_wait()                                    # kernels/pdl.py: before any global access
        griddep_launch_dependents()                       # the combine may be scheduled; it waits for us
        smem = cuda.shared.array(0, float32, alignment=16)
        s_qf = cuda.shared.array(QF, uint32)              # [d/16, 32, 2] the queries' A fragments (a0, a2)
        # code pair -> (level lo, level hi) as f16x2, keys (two coordinates) and values (two tokens); aligned
        # to their size, so a pair's byte offset ORs into the base (lds_u32)
        s_kp = cuda.shared.array(256, uint32, alignment=1024)
        s_vp = cuda.shared.array(256, uint32, alignment=1024)
        kpb = smem_u32(s_kp)
        vpb = smem_u32(s_vp)
        split, hk, tid, w, lane, max_seq, n_kv, per = place(kv_len, k_norms)
        r = lane >> 2                                     # fragment row (head) / column (token, coordinate)
        t = lane & 3
        if split * per >= n_kv:
            return
        mine = w < NWD                                    # warp-uniform: I have coordinates
        xk = cuda.local.array(XK2, uint32)                 # my chunks' words of the two key rows I read
        xv = cuda.local.array(XV4, uint32)                 # and of the four value rows
        sh_k = uint32(2 * k_bits) * uint32(t)             # my code pair in a key group
        sh_v = uint32(v_bits) * uint32(r)                 # my code in a value group
        koff = uint32(KN * NCW) * uint32(w)               # my chunks' first word in a key row
        voff = uint32(VN * NCW) * uint32(w)
        j_end = min(n_kv, (split + 1) * per)
        row0 = uint32(hk * max_seq)                       # rows < Hkv·max_seq < 2^32: uint32 arithmetic
        last = uint32(row0 + uint32(j_end - 1))
        toks = cuda.local.array(4, uint32)                # tokens 2t, 2t + 1, 8 + 2t, 9 + 2t of a tile
        for e in range(4):
            toks[e] = uint32(2 * t + (e & 1) + 8 * (e >> 1))
        # loads run a tile ahead of their use (the codes come from DRAM, ~1 µs away): a tile's rows and norms
        # are read during the tile before it; the first tile's now, under the queries' rotation and the tables
        r_c = uint32(row0 + uint32(split * per))
        if mine:
            for n in range(2):
                row = min(uint32(r_c + uint32(8 * n) + uint32(r)), last)
                load_chunks(k_words, int64(row) * WK + koff, k_bits, xk, XK * n)
            if EARLY_V:
                for e in range(4):
                    row = min(uint32(r_c + toks[e]), last)
                    load_chunks(v_words, int64(row) * WV + voff, v_bits, xv, XV * e)
        nrm = f0
        if w == NW - 1:                                   # norm of token lane & 15 (keys: lanes < 16)
            nrm = tile_norm(k_flat, v_flat, r_c, lane, last)
        rot = cuda.local.array(V, float32)
        for g in range(w, G, NW):                         # s_q [G, d]: the queries · signs, rotated by warps
            rotate_query(q, hk * G + g, k_signs, rot, V, lane)
            for k in range(V):
                smem[OFF_Q + g * d + V * lane + k] = rot[k]
        fill_k(s_kp, k_levels, tid)
        fill_v(s_vp, v_levels, tid)
        cuda.syncthreads()
        for e in range(tid, d // 16 * 32, TPB):           # lane e & 31's (a0, a2) of k-step e >> 5
            gq = (e & 31) >> 2
            c = OFF_Q + gq * d + 16 * (e >> 5) + 2 * (e & 3)
            s_qf[2 * e] = pack_f16x2(smem[c], smem[c + 1]) if gq < G else z
            s_qf[2 * e + 1] = pack_f16x2(smem[c + 8], smem[c + 9]) if gq < G else z
        cuda.syncthreads()
        qa = cuda.local.array(QA, uint32)                 # my (b0, b1) of my warp's k-steps: head r's queries
        for x in range(2 * NCW):
            f = 2 * ((2 * w * NCW + x) * 32 + lane)
            qa[2 * x] = s_qf[f] if mine else z
            qa[2 * x + 1] = s_qf[f + 1] if mine else z
        o = cuda.local.array(NO, float32)                 # O[2t, 2t + 1][16b + r, 16b + 8 + r] of my tiles b
        for x in range(NO):
            o[x] = f0
        m = NEG_INF                                       # head r's running maximum (log2 domain)
        lsum = f0                                         # and my tokens' share of its sum
        sc = cuda.local.array(4, float32)                 # head r at tokens 2t, 2t + 1, 8 + 2t, 9 + 2t
        vw = cuda.local.array(4, float32)
        it = uint32(0)
        for c0 in range(split * per, j_end, TILE):        # block-uniform: every warp, every tile
            r_c = uint32(row0 + uint32(c0))
            buf = uint32(OFF_S + uint32(SHARE) * (it & uint32(1)))
            if w == NW - 1:                               # the tile's norms, scaled for their use below
                smem[uint32(buf + uint32(NW * 128 + lane))] = nrm * (SCORE if lane < 16 else INV_SQRT_D)
                nrm = tile_norm(k_flat, v_flat, uint32(r_c + uint32(TILE)), lane, last)
            if mine and (it > uint32(0) or not EARLY_V):  # my chunks of the value rows of my 4 tokens (the
                for e in range(4):                        # first tile's may have come before the prologue)
                    row = min(uint32(r_c + toks[e]), last)
                    load_chunks(v_words, int64(row) * WV + voff, v_bits, xv, XV * e)
            sk = cuda.local.array(4, float32)             # S[token r, r + 8][head 2t, 2t + 1], my coordinates
            for x in range(4):
                sk[x] = f0
            ka = cuda.local.array(4, uint32)              # A: key rows r, r + 8 at a k-step's 16 coordinates
            if mine:
                for x in range(2 * NCW):                  # k-steps: 2 per chunk
                    for n in range(2):                    # tokens r (n = 0) and 8 + r (n = 1)
                        c = XK * n + KN * (x >> 1)
                        ka[n] = lds_u32(s_kp, kpb | (group_field(xk, c, 2 * (x & 1), k_bits, sh_k, 2) & KP4))
                        ka[2 + n] = lds_u32(s_kp, kpb | (group_field(xk, c, 2 * (x & 1) + 1, k_bits, sh_k, 2) & KP4))
                    sk[0], sk[1], sk[2], sk[3] = mma_f16_16816(ka[0], ka[1], ka[2], ka[3], qa[2 * x], qa[2 * x + 1],
                                                               sk[0], sk[1], sk[2], sk[3])
                for n in range(2):                        # the next tile's key rows (past the split: the last)
                    row = min(uint32(r_c + uint32(TILE + 8 * n) + uint32(r)), last)
                    load_chunks(k_words, int64(row) * WK + koff, k_bits, xk, XK * n)
            # my share as [head][token at 4·((k & 7) >> 1) + (k & 1) + 2·(k >> 3)]: lane (r, t) reads head r's
            # tokens 2t, 2t + 1, 8 + 2t, 9 + 2t as one 16-byte load
            at = uint32(buf + uint32(128 * w) + uint32(32) * uint32(t) + uint32(4) * (uint32(r) >> uint32(1))
                        + (uint32(r) & uint32(1)))
            smem[at] = sk[0]
            smem[uint32(at + uint32(16))] = sk[1]
            smem[uint32(at + uint32(2))] = sk[2]
            smem[uint32(at + uint32(18))] = sk[3]
            cuda.syncthreads()                            # every warp's share and the norms are in
            for e in range(4):
                sc[e] = f0
            for u in range(NWD):                          # the same sums, in the same order, in every warp
                s0, s1, s2, s3 = ld_shared_v4_f32(smem, uint32(4) * uint32(buf + uint32(128 * u + 4 * lane)))
                sc[0] += s0
                sc[1] += s1
                sc[2] += s2
                sc[3] += s3
            mx = NEG_INF
            lim = uint32(min(j_end - c0, TILE))           # the tile's tokens before the split's end (>= 1)
            for e in range(4):
                sc[e] = sc[e] * smem[uint32(buf + uint32(NW * 128) + toks[e])] if toks[e] < lim else NEG_INF
                vw[e] = smem[uint32(buf + uint32(NW * 128 + 16) + toks[e])]
                mx = max(mx, sc[e])
            it += uint32(1)
            mx = max(mx, shfl_xor_f32(mx, 1))             # over the 4 lanes of head r: the tile's 16 tokens
            mx = max(mx, shfl_xor_f32(mx, 2))
            if vote_any(mx > m):                          # a head's maximum grew (rare after the first tiles)
                alpha = math.exp2(m - max(m, mx))         # head r's; 0 from -inf, 1 where it did not grow
                lsum *= alpha
                m = max(m, mx)
                al0 = shfl_idx_f32(alpha, 8 * t)          # my output columns' heads 2t, 2t + 1
                al1 = shfl_idx_f32(alpha, 8 * t + 4)
                for x in range(NO // 2):
                    o[2 * x] *= al0
                    o[2 * x + 1] *= al1
            for e in range(4):                            # p = 0 past j_end (score -inf): m is finite from
                p = math.exp2(sc[e] - m)                  # the first tile on (its token 0 counts in mx)
                lsum += p
                vw[e] = p * vw[e]
            pa0 = pack_f16x2(vw[0], vw[1])
            pa2 = pack_f16x2(vw[2], vw[3])
            if mine:
                va = cuda.local.array(4, uint32)          # A: coordinates r, 8 + r of a 16-coordinate tile
                for b in range(NO // 4):                  # output tiles of 16 coordinates: 2 per chunk
                    c = VN * (b >> 1)
                    for h in range(2):                    # groups 2b, 2b + 1 of the chunk: coordinate 8h + r
                        j = 2 * (b & 1) + h
                        # tokens (2t, 2t + 1), then (8 + 2t, 9 + 2t), as one pair each
                        i0 = ((group_field(xv, c, j, v_bits, sh_v, 2) & V4)
                              | (group_field(xv, XV + c, j, v_bits, sh_v, 2 + v_bits) & V4B))
                        i1 = ((group_field(xv, 2 * XV + c, j, v_bits, sh_v, 2) & V4)
                              | (group_field(xv, 3 * XV + c, j, v_bits, sh_v, 2 + v_bits) & V4B))
                        va[h] = lds_u32(s_vp, vpb | i0)
                        va[2 + h] = lds_u32(s_vp, vpb | i1)
                    o[4 * b], o[4 * b + 1], o[4 * b + 2], o[4 * b + 3] = mma_f16_16816(
                        va[0], va[1], va[2], va[3], pa0, pa2, o[4 * b], o[4 * b + 1], o[4 * b + 2], o[4 * b + 3])
        lsum += shfl_xor_f32(lsum, 1)                     # head r's sum over its 4 lanes
        lsum += shfl_xor_f32(lsum, 2)
        # every warp holds the block's (max, sum) and its own coordinates: all of it goes to the merge's
        # first slot, the other slots are empty (max -inf)
        if mine:                                          # O[head 2t, 2t + 1][coordinates 16b + r, + 8]
            for b in range(NO // 4):
                for h in range(2):
                    col = CPW * w + 16 * b + 8 * h + r
                    if 2 * t < G:
                        smem[OFF_A + 2 * t * d + col] = o[4 * b + 2 * h]
                    if 2 * t + 1 < G:
                        smem[OFF_A + (2 * t + 1) * d + col] = o[4 * b + 2 * h + 1]
        if w == 0 and r < G and t == 0:
            smem[OFF_ML + 2 * r] = m
            smem[OFF_ML + 2 * r + 1] = lsum
            for u in range(1, NW):
                smem[OFF_ML + 2 * (u * G + r)] = NEG_INF
        merge(smem, rot, lane, w, tid, split, hk, part_o, part_ml, v_signs)

    return partial, split_combine_kernel(d, n_splits, STEP, gated)
