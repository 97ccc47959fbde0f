"""Decode attention over the 3/4-bit KV cache, third partial kernel: scores and values on tensor cores.

Same inputs, outputs, split-K contract, rotation back (decode.split_rotate_out) and combine as kvq/decode.py
(read its docstring first); only the partial's main loop differs. decode.py and decode_tokens.py spend ~230 and ~148
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
  end     every warp holds the common (max, sum) and its own coordinates of the split's output: nothing to
          merge; they go to s_a and are rotated back as for the other partials, warp 0 writes (max, sum).

Loads: the codes come from DRAM (in the step the weights' GEMVs have just evicted them). A block's tiles
(16 key rows, 16 value rows and their norms: contiguous runs of the caches) are copied with cp.async into a
ring of STAGES = 4 shared-memory stages; tile i + 3's copies are issued during tile i, so three tiles are
in flight while one is used, and each warp reads its chunks of a row from shared memory as 8-byte loads.
With registers loaded one tile ahead instead the partial ran at ~700 GB/s, as long with the
codes in L2 as from DRAM and no faster after its loop lost 25 % of its instructions: each tile waited for
its loads' round trip. The copies need whole tiles of rows: engine/cache.py allocates coded caches in
multiples of 16 rows, and a cache of other rows is refused.

Offline sm_90a (9B shape): 102 (k3v3), 100 (k4v3), 96 (k4v4) registers, no local memory; the main loop
397 SASS a tile at k3v3 (945 while the copies were a loop over a tile's chunks with a branch per run).
Heads as the rows of A (queries fixed, rows >= G zero) took 16 mma and 42 register moves a tile: ptxas
rebuilt the zero halves of the A operands before every mma. 3 and 4 bits only, up to 8 query heads per KV
head (the columns of one mma).

Lookups: a pair table of 3-bit codes has 64 entries, so one copy puts entries e and e + 32 in one bank and
a warp's random lookups take two shared-memory wavefronts; each lane has its own copy (entry e of lane l at
word 32e + l: 8 KB a table), so every lookup is one wavefront. 4-bit tables (256 entries) stay single.

Buffers as decode.py; shared memory (dynamic): s_q [G, d] f32 (rotated queries) | s_s [2, NW, 8, 16] |
the ring [STAGES, stage_words] u32, after the loop the split's output s_a [G, d] f32 | the pair
tables (u32 f16x2: [64, 32] at 3 bits, [256] at 4), each at an address aligned to its size. Before the loop
s_s holds s_qf [d/16, 32, 2] u32 (the queries' A fragments (a0, a2), read once into registers). Caches as
decode.py's, rows a multiple of 16. At 3 bits and d = 256: 44.2 KB a block at 4 query heads a KV head,
48.2 KB at 8 (past the default 48 KiB: the launcher opts in, kernels/dynamic_smem.py).
"""
from __future__ import annotations

from functools import lru_cache

import math

from numba import float32, int64, uint32

from ninfer_numba.kernels.flash_attn.decode import LOG2E, h2_to_f32
from ninfer_numba.kernels.flash_attn.mma_f16 import mma_f16_16816, pack_f16x2
from ninfer_numba.kernels.flash_attn.split_combine import split_combine_kernel
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.decode import (MMA_MAX_GROUP, MMA_TILE, NEG_INF, NW, TPB, block_place, funnel,
                                             rotate_query, split_rotate_out)
from ninfer_numba.kernels.kvq.decode_tokens import lds_u32
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, device_inline
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.ptx import (cp_async_commit, cp_async_wait_1, cp_async_wait_2, cp_async_wait_all,
                                      ex2_approx, shfl_idx_f32, shfl_xor_f32, vote_any)
from ninfer_numba.kernels.ptx_sm90 import cp_async_16b, ld_shared_v2_u32, ld_shared_v4_f32, smem_u32

TILE = MMA_TILE             # tokens per tile: the k dimension of the values' mma
STEP = TILE                 # a split's keys are whole tiles (every warp walks every tile)
MAX_G = MMA_MAX_GROUP       # query heads per KV head: the B columns of one mma that are not padding


def table_words(bits: int) -> tuple[int, int]:
    """(words, byte alignment) of a pair table: at 3 bits 64 pairs × 32 lanes' copies, at 4 bits 256 pairs;
    aligned to their size, so that a looked-up offset ORs into the base."""
    words = 64 * 32 if bits == 3 else 256
    return words, 4 * words


@lru_cache(maxsize=None)
def pair_table_filler(bits: int, copies: int = 1):
    """fill(words, at, levels, tid): words[at + (c0 | c1 << bits)·copies + k] = (levels[c0], levels[c1]) as
    one f16x2 word for every pair of codes and each of ``copies`` (a power of two) copies, by a block of TPB
    threads (this partial's lookups of two codes at once; a copy per lane keeps a warp's lookups off each
    other's banks)."""
    mask = (1 << bits) - 1
    shift = copies.bit_length() - 1
    if bits == 3 and copies == 32 and TPB == 128:
        # a copy per lane: thread (w, l) writes word 32e + l of entries e = w + 4j, whose first code is level
        # w or w + 4 (j even, odd) and whose second is level j >> 1: 10 loads held in registers, 16 stores
        @cuda.jit(device=True, inline=True)
        def fill_lanes(words, at, levels, tid):
            w = tid >> 5
            lo_even = levels[w]
            lo_odd = levels[w + 4]
            for j in range(16):
                words[at + tid + 128 * j] = pack_f16x2(lo_odd if j & 1 else lo_even, levels[j >> 1])
        return fill_lanes

    @cuda.jit(device=True, inline=True)
    def fill(words, at, levels, tid):
        for i in range(tid, copies << (2 * bits), TPB):
            e = i >> shift
            words[at + i] = pack_f16x2(levels[e & mask], levels[e >> bits])
    return fill


def warp_coordinates(d: int) -> int:
    """Coordinates of the keys' reduction and of the output each warp takes: a quarter of d, at least one
    chunk of 32 (at d < 128 the warps past d / 32 only follow the softmax)."""
    return max(32, d // NW)


SHARE = NW * 8 * 16          # words of one s_s buffer: the warps' shares of a tile's scores
STAGES = 4                   # tiles in the ring: tile i + 3's copies are issued during tile i


def stage_words(d: int, k_bits: int, v_bits: int) -> int:
    """Words of one ring stage: a tile's 16 key rows, its 16 value rows (codes as cached), then the 16 key
    norms and the 16 value norms (float16 pairs, 8 words each)."""
    return 16 * (d * k_bits // 32 + d * v_bits // 32) + 16


def smem_words(G: int, d: int, k_bits: int, v_bits: int) -> tuple[int, ...]:
    """(offsets of s_q, s_s, the ring, the tables; total words) of the partial's dynamic shared memory;
    s_s [2, SHARE] holds each warp's share of a tile's scores [NW, 8 heads, 16 tokens], double-buffered (one
    barrier per tile). The ring [STAGES, stage_words] ends with the main loop; the split's output s_a [G, d]
    then takes its words (every offset a multiple of 4 words: the ring's stages are 16-byte cp.async
    targets). Then the two pair tables (table_words), the one with the larger alignment
    first, each at an address aligned to its size: the kernel finds that address in the words after off_t
    (the shared window's alignment of dynamic memory is not known ahead), so they hold one alignment more."""
    off_q = 0
    off_s = off_q + G * d
    off_a = off_s + 2 * SHARE
    off_t = off_a + max(G * d, STAGES * stage_words(d, k_bits, v_bits))
    (kw, ka), (vw, va) = table_words(k_bits), table_words(v_bits)
    return off_q, off_s, off_a, off_t, off_t + kw + vw + max(ka, va) // 4


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
    QF = 2 * (d // 16) * 32      # s_qf words: the queries' fragments, in s_s's words before the loop
    assert QF <= 2 * SHARE
    WK = d * k_bits // 32        # words of a coded key row
    WV = d * v_bits // 32
    # my words of a row as 8-byte shared loads where they are whole aligned pairs (d >= 64)
    PK = XK % 2 == 0 and WK % 2 == 0
    PV = XV % 2 == 0 and WV % 2 == 0
    STW = stage_words(d, k_bits, v_bits)
    KCH, VCH = 4 * WK, 4 * WV    # 16-byte chunks of a tile's 16 key rows, of its 16 value rows
    if max(KCH, VCH) > TPB:
        raise ValueError(f"a tile's rows of {d} coordinates at {k_bits}/{v_bits} bits are more 16-byte chunks "
                         f"than the block has threads ({TPB})")
    NRM = 4 * 16 * (WK + WV)     # byte of a stage's key norms (its value norms 32 bytes on)
    # a pair table of 3-bit codes (64 entries) holds a copy per lane, entry e of lane l at word 32e + l, so
    # that a warp's 32 lookups hit 32 banks (one copy: entries e and e + 32 share a bank, 2 wavefronts a
    # lookup); at 4 bits (256 entries) one copy. A looked-up field is extracted straight to its byte offset's
    # bits (bit 7 in a lane-wide table, else bit 2), so that one LOP3 masks it and ORs the table's base in
    KPRE = 7 if k_bits == 3 else 2
    VPRE = 7 if v_bits == 3 else 2
    KP4 = uint32(((1 << (2 * k_bits)) - 1) << KPRE)       # a key pair's table byte offset
    V4 = uint32(((1 << v_bits) - 1) << VPRE)              # the first token's code in a value pair's offset
    V4B = uint32(((1 << v_bits) - 1) << (VPRE + v_bits))  # the second token's
    KTW, KTA = table_words(k_bits)
    VTW, VTA = table_words(v_bits)
    TA = max(KTA, VTA)                  # the first table's alignment (bytes); the second follows it
    K_FIRST = KTA >= VTA
    OFF_Q, OFF_S, OFF_A, OFF_T, _ = smem_words(G, d, k_bits, v_bits)
    INV_SQRT_D = float32(1.0 / math.sqrt(d))
    SCORE = float32(LOG2E / d ** 1.5)
    f0 = float32(0.0)
    z = uint32(0)
    rotate_out = split_rotate_out(G, d, OFF_A)
    place = block_place(n_splits, STEP)
    fill_k = pair_table_filler(k_bits, KTW >> (2 * k_bits))
    fill_v = pair_table_filler(v_bits, VTW >> (2 * v_bits))
    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 4)}

    @device_inline
    def issue_tile(ring, k_words, v_words, k_flat, v_flat, r_c, at, tid):
        """cp.async of the tile at row r_c to ring byte ``at``: its 16 key rows and 16 value rows are contiguous
        runs of the caches (KCH, VCH <= TPB chunks of 16 bytes: thread tid copies chunk tid of each), as are
        their norms (the block's last four threads). No loop: one predicated copy per run a thread."""
        if tid < KCH:
            cp_async_16b(ring, uint32(at + uint32(16) * uint32(tid)), k_words, int64(r_c) * WK + 4 * tid)
        if tid < VCH:
            cp_async_16b(ring, uint32(at + uint32(16 * KCH) + uint32(16) * uint32(tid)), v_words,
                         int64(r_c) * WV + 4 * tid)
        if tid >= TPB - 4:                                # key norms 0-7, 8-15, then the values'
            n = tid - (TPB - 4)
            dst = uint32(at + uint32(16 * (KCH + VCH)) + uint32(16) * uint32(n))
            if n < 2:
                cp_async_16b(ring, dst, k_flat, int64(r_c) + 8 * n)
            else:
                cp_async_16b(ring, dst, v_flat, int64(r_c) + 8 * (n - 2))

    @device_inline
    def load_words(ring, ringb, at, x, o, n, pairs):
        """x[o:o + n] = the n words at ring byte ``at`` (8-byte loads when ``pairs``)."""
        if pairs:
            for u in range(n // 2):
                x[o + 2 * u], x[o + 2 * u + 1] = ld_shared_v2_u32(ring, uint32(at + uint32(8 * u)))
        else:
            for u in range(n):
                x[o + u] = lds_u32(ring, uint32(ringb + at + uint32(4 * u)))

    @device_inline
    def group_field(x, o, j, bits, sh, pre):
        """Bits sh.. (sh + a field < 24 or 32) of code group j (of 4 per chunk) of the chunk's words at x[o:],
        moved to bit pre (<= 16; the caller masks): a 24-bit group is at bit 24j of the chunk's three words, a
        4-bit group is word j. At 3 bits the move is one funnel shift whichever its direction: groups 0 and 3
        (inside one word) pair their word with a zero word, so that a shift right of less than 32 moves the
        field left."""
        if bits == 4:
            return (x[o + j] >> sh) << uint32(pre)
        if j == 0:
            return funnel(x[o], z, uint32(32 - pre) + sh)
        if j == 1:
            return funnel(x[o + 1], x[o], uint32(24 - pre) + sh)
        if j == 2:
            return funnel(x[o + 2], x[o + 1], uint32(16 - pre) + sh)
        return funnel(x[o + 2], z, uint32(40 - pre) + sh)

    @cached_jit(pdl=True, **occupancy)
    def partial(q, k_words, k_norms, v_words, v_norms, kv_len, k_signs, k_levels, v_levels, v_signs, part_o,
                part_ml, k_flat, v_flat):
        griddep_wait()                                    # kernels/pdl.py: before any global access
        griddep_launch_dependents()                       # the combine may be scheduled; it waits for us
        smem = cuda.shared.array(0, float32, alignment=16)
        split, hk, tid, w, lane, max_seq, n_kv, per = place(kv_len, k_norms)
        r = lane >> 2                                     # fragment row (head) / column (token, coordinate)
        t = lane & 3
        ring = cuda.shared.array(0, uint32, alignment=16)  # the same dynamic words as smem, as code words
        ringb = smem_u32(ring)
        # the pair tables (code pair -> (level lo, level hi) as f16x2, keys: two coordinates, values: two
        # tokens) at shared addresses aligned to their sizes, so that a looked-up offset ORs into the base
        tb = (uint32(ringb + uint32(4 * OFF_T)) + uint32(TA - 1)) & ~uint32(TA - 1)
        k_tab = tb if K_FIRST else uint32(tb + uint32(4 * VTW))
        v_tab = uint32(tb + uint32(4 * KTW)) if K_FIRST else tb
        kpb = k_tab | (uint32(lane) << uint32(2) if KTW > 256 else z)   # my copy in a lane-wide table
        vpb = v_tab | (uint32(lane) << uint32(2) if VTW > 256 else z)
        if split * per >= n_kv:
            return
        mine = w < NWD                                    # warp-uniform: I have coordinates
        c_first = split * per
        j_end = min(n_kv, c_first + per)
        row0 = uint32(hk * max_seq)                       # rows < Hkv·max_seq < 2^32: uint32 arithmetic
        # the codes come from DRAM (~1 µs away): the ring's first STAGES - 1 tiles are in flight under the
        # queries' rotation and the tables; each tile's copies are a group (empty past the split's end), so
        # that "all but the newest n groups" names a tile
        for u in range(STAGES - 1):
            if c_first + TILE * u < j_end:
                issue_tile(ring, k_words, v_words, k_flat, v_flat, uint32(row0 + uint32(c_first + TILE * u)),
                           uint32(4 * OFF_A + 4 * STW * u), tid)
            cp_async_commit()
        xk = cuda.local.array(XK2, uint32)                 # my chunks' words of the two key rows I read
        xv = cuda.local.array(XV4, uint32)                 # and of the four value rows
        sh_k = uint32(2 * k_bits) * uint32(t)             # my code pair in a key group
        sh_v = uint32(v_bits) * uint32(r)                 # my code in a value group
        # ring bytes of my chunks in a stage: key rows r and 8 + r, the value rows of my 4 tokens
        kat = uint32(4 * (r * WK + XK * w))
        toks = cuda.local.array(4, uint32)                # tokens 2t, 2t + 1, 8 + 2t, 9 + 2t of a tile
        vat = cuda.local.array(4, uint32)
        for e in range(4):
            toks[e] = uint32(2 * t + (e & 1) + 8 * (e >> 1))
            vat[e] = uint32(4 * (16 * WK + toks[e] * WV + XV * w))
        rot = cuda.local.array(V, float32)
        for g in range(w, G, NW):                         # s_q [G, d]: the queries · signs, rotated by warps
            rotate_query(q, hk * G + g, k_signs, rot, V, lane)
            for k in range(V):
                smem[OFF_Q + g * d + V * lane + k] = rot[k]
        fill_k(ring, uint32(k_tab - ringb) >> uint32(2), k_levels, tid)
        fill_v(ring, uint32(v_tab - ringb) >> uint32(2), v_levels, tid)
        cuda.syncthreads()
        for e in range(tid, d // 16 * 32, TPB):           # lane e & 31's (a0, a2) of k-step e >> 5
            gq = (e & 31) >> 2
            c = OFF_Q + gq * d + 16 * (e >> 5) + 2 * (e & 3)
            ring[OFF_S + 2 * e] = pack_f16x2(smem[c], smem[c + 1]) if gq < G else z
            ring[OFF_S + 2 * e + 1] = pack_f16x2(smem[c + 8], smem[c + 9]) if gq < G else z
        cp_async_wait_2()                                 # my copies of tile 0 have landed
        cuda.syncthreads()                                # everyone's, and s_qf
        qa = cuda.local.array(QA, uint32)                 # my (b0, b1) of my warp's k-steps: head r's queries
        for x in range(2 * NCW):
            f = 2 * ((2 * w * NCW + x) * 32 + lane)
            qa[2 * x] = ring[OFF_S + f] if mine else z
            qa[2 * x + 1] = ring[OFF_S + f + 1] if mine else z
        cuda.syncthreads()                                # s_qf read: s_s takes its words
        o = cuda.local.array(NO, float32)                 # O[2t, 2t + 1][16b + r, 16b + 8 + r] of my tiles b
        for x in range(NO):
            o[x] = f0
        m = NEG_INF                                       # head r's running maximum (log2 domain)
        lsum = f0                                         # and my tokens' share of its sum
        sc = cuda.local.array(4, float32)                 # head r at tokens 2t, 2t + 1, 8 + 2t, 9 + 2t
        vw = cuda.local.array(4, float32)
        it = uint32(0)
        at = uint32(4 * OFF_A)                            # this tile's stage (ring byte)
        for c0 in range(c_first, j_end, TILE):            # block-uniform: every warp, every tile
            buf = uint32(OFF_S + uint32(SHARE) * (it & uint32(1)))
            sk = cuda.local.array(4, float32)             # S[token r, r + 8][head 2t, 2t + 1], my coordinates
            for x in range(4):
                sk[x] = f0
            ka = cuda.local.array(4, uint32)              # A: key rows r, r + 8 at a k-step's 16 coordinates
            if mine:
                for n in range(2):                        # tokens r (n = 0) and 8 + r (n = 1)
                    load_words(ring, ringb, uint32(at + kat + uint32(32 * WK * n)), xk, XK * n, XK, PK)
                for x in range(2 * NCW):                  # k-steps: 2 per chunk
                    for n in range(2):
                        c = XK * n + KN * (x >> 1)
                        f0_ = group_field(xk, c, 2 * (x & 1), k_bits, sh_k, KPRE)
                        f1_ = group_field(xk, c, 2 * (x & 1) + 1, k_bits, sh_k, KPRE)
                        ka[n] = lds_u32(ring, kpb | (f0_ & KP4))
                        ka[2 + n] = lds_u32(ring, kpb | (f1_ & KP4))
                    sk[0], sk[1], sk[2], sk[3] = mma_f16_16816(ka[0], ka[1], ka[2], ka[3], qa[2 * x], qa[2 * x + 1],
                                                               sk[0], sk[1], sk[2], sk[3])
            # my share as [head][token at 4·((k & 7) >> 1) + (k & 1) + 2·(k >> 3)]: lane (r, t) reads head r's
            # tokens 2t, 2t + 1, 8 + 2t, 9 + 2t as one 16-byte load
            sat = uint32(buf + uint32(128 * w) + uint32(32) * uint32(t) + uint32(4) * (uint32(r) >> uint32(1))
                         + (uint32(r) & uint32(1)))
            smem[sat] = sk[0]
            smem[uint32(sat + uint32(16))] = sk[1]
            smem[uint32(sat + uint32(2))] = sk[2]
            smem[uint32(sat + uint32(18))] = sk[3]
            cp_async_wait_1()                             # my copies of the next tile have landed
            cuda.syncthreads()                            # every warp's share is in, and the next tile
            # tile + STAGES - 1 into the stage tile - 1 used: every warp is past that tile
            free = uint32(at - uint32(4 * STW)) if at > uint32(4 * OFF_A) else uint32(4 * (OFF_A + (STAGES - 1) * STW))
            if c0 + TILE * (STAGES - 1) < j_end:
                issue_tile(ring, k_words, v_words, k_flat, v_flat, uint32(row0 + uint32(c0 + TILE * (STAGES - 1))),
                           free, tid)
            cp_async_commit()
            # the same sums, in the same order, in every warp
            sc[0], sc[1], sc[2], sc[3] = ld_shared_v4_f32(smem, uint32(4) * uint32(buf + uint32(4 * lane)))
            for u in range(1, NWD):
                s0, s1, s2, s3 = ld_shared_v4_f32(smem, uint32(4) * uint32(buf + uint32(128 * u + 4 * lane)))
                sc[0] += s0
                sc[1] += s1
                sc[2] += s2
                sc[3] += s3
            mx = NEG_INF
            lim = uint32(min(j_end - c0, TILE))           # the tile's tokens before the split's end (>= 1)
            nat = uint32(ringb + at + uint32(NRM) + uint32(4) * uint32(t))
            for h in range(2):                            # norms of tokens 2t, 2t + 1 (h = 0), 8 + 2t, 9 + 2t
                kn0, kn1 = h2_to_f32(lds_u32(ring, uint32(nat + uint32(16 * h))))
                vn0, vn1 = h2_to_f32(lds_u32(ring, uint32(nat + uint32(32 + 16 * h))))
                sc[2 * h] *= kn0 * SCORE
                sc[2 * h + 1] *= kn1 * SCORE
                vw[2 * h] = vn0 * INV_SQRT_D
                vw[2 * h + 1] = vn1 * INV_SQRT_D
            for e in range(4):                            # rows past the split's end: scores -inf, weights 0
                if toks[e] >= lim:                        # (their norms are whatever the rows hold)
                    sc[e] = NEG_INF
                    vw[e] = f0
                mx = max(mx, sc[e])
            it += uint32(1)
            mx = max(mx, shfl_xor_f32(mx, 1))             # over the 4 lanes of head r: the tile's 16 tokens
            mx = max(mx, shfl_xor_f32(mx, 2))
            if vote_any(mx > m):                          # a head's maximum grew (rare after the first tiles)
                alpha = ex2_approx(m - max(m, mx))        # head r's; 0 from -inf, 1 where it did not grow
                lsum *= alpha
                m = max(m, mx)
                al0 = shfl_idx_f32(alpha, 8 * t)          # my output columns' heads 2t, 2t + 1
                al1 = shfl_idx_f32(alpha, 8 * t + 4)
                for x in range(NO // 2):
                    o[2 * x] *= al0
                    o[2 * x + 1] *= al1
            for e in range(4):                            # p = 0 past j_end (score -inf): m is finite from
                p = ex2_approx(sc[e] - m)                 # the first tile on (its token 0 counts in mx)
                lsum += p
                vw[e] = p * vw[e]
            pa0 = pack_f16x2(vw[0], vw[1])
            pa2 = pack_f16x2(vw[2], vw[3])
            if mine:
                for e in range(4):                        # my chunks of the value rows of my 4 tokens
                    load_words(ring, ringb, uint32(at + vat[e]), xv, XV * e, XV, PV)
                va = cuda.local.array(4, uint32)          # A: coordinates r, 8 + r of a 16-coordinate tile
                for b in range(NO // 4):                  # output tiles of 16 coordinates: 2 per chunk
                    c = VN * (b >> 1)
                    for h in range(2):                    # groups 2b, 2b + 1 of the chunk: coordinate 8h + r
                        j = 2 * (b & 1) + h
                        # tokens (2t, 2t + 1), then (8 + 2t, 9 + 2t), as one pair each
                        i0 = ((group_field(xv, c, j, v_bits, sh_v, VPRE) & V4)
                              | (group_field(xv, XV + c, j, v_bits, sh_v, VPRE + v_bits) & V4B))
                        i1 = ((group_field(xv, 2 * XV + c, j, v_bits, sh_v, VPRE) & V4)
                              | (group_field(xv, 3 * XV + c, j, v_bits, sh_v, VPRE + v_bits) & V4B))
                        va[h] = lds_u32(ring, vpb | i0)
                        va[2 + h] = lds_u32(ring, vpb | i1)
                    o[4 * b], o[4 * b + 1], o[4 * b + 2], o[4 * b + 3] = mma_f16_16816(
                        va[0], va[1], va[2], va[3], pa0, pa2, o[4 * b], o[4 * b + 1], o[4 * b + 2], o[4 * b + 3])
            at = uint32(at + uint32(4 * STW)) if at < uint32(4 * (OFF_A + (STAGES - 1) * STW)) else uint32(4 * OFF_A)
        cp_async_wait_all()                               # only empty groups are left: the ring is done with,
        cuda.syncthreads()                                # and every warp past its last tile: s_a takes it
        lsum += shfl_xor_f32(lsum, 1)                     # head r's sum over its 4 lanes
        lsum += shfl_xor_f32(lsum, 2)
        # every warp holds the block's (max, sum) and its own coordinates of one softmax: nothing to merge
        # (split_merge's walk over the warps' slots cost ~1,260 SASS a warp, 2.5 tiles' worth); the
        # coordinates go to s_a [G, d] and are rotated back, warp 0 writes the split's (max, sum)
        if mine:                                          # O[head 2t, 2t + 1][coordinates 16b + r, + 8]
            for b in range(NO // 4):
                for h in range(2):
                    col = CPW * w + 16 * b + 8 * h + r
                    if 2 * t < G:
                        smem[OFF_A + 2 * t * d + col] = o[4 * b + 2 * h]
                    if 2 * t + 1 < G:
                        smem[OFF_A + (2 * t + 1) * d + col] = o[4 * b + 2 * h + 1]
        if w == 0 and r < G and t == 0:
            part_ml[split, hk * G + r, 0] = m
            part_ml[split, hk * G + r, 1] = lsum
        cuda.syncthreads()
        rotate_out(smem, rot, lane, w, split, hk, part_o, v_signs)

    return partial, split_combine_kernel(d, n_splits, STEP, gated)
