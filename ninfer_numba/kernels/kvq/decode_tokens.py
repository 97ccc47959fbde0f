"""Decode attention over the 3/4-bit KV cache, second partial kernel: the keys are scored one token per lane.

Same inputs, outputs, split-K contract and combine as kvq/decode.py (read its docstring first); only the
partial's main loop differs. decode.py's partial gives lane l coordinates 8l .. 8l + 7 of every row, so a
key score is 32 lanes' shares summed by a shuffle butterfly, and the online softmax runs on chunks of 4
tokens; the butterfly, the softmax and the 64-bit row arithmetic are ~100 of its ~231 SASS instructions per
(token, KV head). Here a warp takes tiles of 32 consecutive tokens (tiles w, w + NW, ...):

  keys    lane t walks the whole coded key row of token t itself: 128 codes per three 16-byte loads at
          3 bits (one per 32 codes at 4), each code a table load and G FMAs against the rotated queries,
          which sit in shared memory as s_q [d, GP] (GP = G rounded up to 4), so one uniform 16-byte load
          gives four heads' values at a coordinate. A lane ends with its token's G scores: no butterfly.
  softmax per head once per tile: a 5-step shuffle maximum, the rescale when it grows; the sums stay
          per lane until the end of the split.
  values  as in decode.py: lane l owns coordinates 8l .. 8l + 7 of every value row (one 24-bit group or
          one word, straight from global memory, fetched 8 tokens ahead); the tile's weights
          p · n_v / sqrt(d) go through shared memory s_p [NW, 32, GP], read back as uniform 16-byte loads
          (one per four heads per token, where shuffles would take one per head).

SASS per (token, KV head) at the 9B shape (G = 4, d = 256, k3v3; ptxas sm_90a, loop bodies counted from
cuobjdump): keys 2 × 1,054 per 128-code block / 32 tokens = 66 (per code 4 FFMA, a table LDS, a query
LDS.128, a SHF and a LOP3), values 8 × 298 per 4-token batch / 32 = 74.5, softmax and tile ~8: ~148,
against ~229 for decode.py's partial. 127 registers, no local memory.

Buffers as decode.py; shared memory (float32 words): s_q [d, GP] | s_p [NW, 32, GP] | s_ml [NW, G, 2] |
s_a [NW, G, d] (the warps' accumulators for the merge), plus the static codebooks [16] each.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import float32, uint32, uint64

from ninfer_numba.kernels.flash_attn.decode import LOG2E, h2_to_f32
from ninfer_numba.kernels.flash_attn.split_combine import split_combine_kernel
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.decode import (NEG_INF, NW, TPB, block_place, funnel, raise_max, rotate_query,
                                             split_tail)
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, device_inline
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.ptx import ldg_nc_v4_u32, shfl_xor_f32, syncwarp
from ninfer_numba.kernels.ptx_sm90 import ld_shared_v4_f32, smem_u32

TILE = 32                   # tokens per warp tile: one per lane
STEP = TILE * NW            # a split's keys are whole multiples of this: every warp has a tile
VB = 4                      # value code groups fetched per batch (two batches in flight)


def padded_heads(G: int) -> int:
    """Query heads per KV head rounded up to 4: the stride of s_q and s_p, so a coordinate's (or a token's)
    values for four heads are one 16-byte shared load."""
    return (G + 3) // 4 * 4


def smem_words(G: int, d: int) -> tuple[int, ...]:
    """(offsets of s_q, s_p, s_ml, s_a; total words) of the partial's dynamic shared memory."""
    GP = padded_heads(G)
    off_q = 0
    off_p = off_q + d * GP
    off_ml = off_p + NW * TILE * GP
    off_a = off_ml + 2 * NW * G
    return off_q, off_p, off_ml, off_a, off_a + NW * G * d


def _make_lds(u32: bool):
    """``lds_f32(smem, addr)`` / ``lds_u32``: the float32 (uint32) at 32-bit shared address ``addr`` inside
    the shared array smem (addr = smem_u32(smem) + byte offset). numba's indexing builds a 64-bit shared
    address that ptxas rebuilds from the CTA's window base, one more add per code; with a table aligned to
    its size the code's offset is OR-ed into the base by the LOP3 that masks it, so a code costs a shift, a
    LOP3 and the LDS."""
    if SIMULATOR:
        @cuda.jit(device=True)
        def lds(smem, addr):
            return smem[int(addr) // 4]           # the twin of smem_u32 is 0: addr is the byte offset
        return lds
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
    ty, ir_ty, op = ((types.uint32, ir.IntType(32), "u32") if u32 else (types.float32, ir.FloatType(), "f32"))

    @intrinsic
    def lds(typingctx, smem, addr):
        sig = ty(smem, addr)

        def codegen(context, builder, sig, args):
            # a memory clobber keeps it after the barrier that publishes the table
            fn = ir.InlineAsm(ir.FunctionType(ir_ty, [ir.IntType(32)]), f"ld.shared.{op} $0, [$1];",
                              f"={'r' if u32 else 'f'},r,~{{memory}}", side_effect=True)
            return builder.call(fn, [context.cast(builder, args[1], sig.args[1], types.uint32)])
        return sig, codegen
    return lds


lds_f32 = _make_lds(False)
lds_u32 = _make_lds(True)


@lru_cache(maxsize=None)
def _kernels(H: int, Hkv: int, d: int, k_bits: int, v_bits: int, n_splits: int, gated: bool = False):
    if d % 32 or d > 256 or d & (d - 1) or H % Hkv:
        raise ValueError(f"unsupported kvq decode: H={H}, Hkv={Hkv}, d={d} (a power of two, 32 <= d <= 256)")
    if not {k_bits, v_bits} <= {3, 4}:
        raise ValueError(f"the token-lane partial decodes 3- and 4-bit codes, not k{k_bits}v{v_bits} "
                         "(variant='lanes' decodes 8-bit ones)")
    G = H // Hkv
    GP = padded_heads(G)
    V = d // 32
    LANES = d // 8
    R8 = 8 * G
    WK = d * k_bits // 32
    WV = d * v_bits // 32
    # key words per block: 12 (128 codes, three 16-byte loads) at 3 bits when rows are whole 16-byte runs,
    # else 3 (32 codes, word loads: rows of 12 or 24 bytes); 4 (32 codes, one 16-byte load) at 4 bits
    KB = 4 if k_bits == 4 else (12 if d % 128 == 0 else 3)
    V4 = k_bits == 4 or KB == 12
    NB = WK // KB
    CPB = KB * 32 // k_bits        # codes per block
    QS = 4 * GP                    # bytes between coordinates of s_q
    OFF_Q, OFF_P, OFF_ML, OFF_A, _ = smem_words(G, d)
    INV_SQRT_D = float32(1.0 / math.sqrt(d))
    SCORE = float32(LOG2E / d ** 1.5)
    KMASK = uint32((1 << k_bits) - 1)
    VMASK = uint32((1 << v_bits) - 1)
    f0 = float32(0.0)
    tail = split_tail(G, d, OFF_A, OFF_ML)
    place = block_place(n_splits, STEP)
    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 4)}

    @device_inline
    def key_code(s_lvl, lb, smem, x, sh, qb, sc):
        """sc[g] += s_q[i, g] · level(code at bit sh of word x) for every head g; qb = 4·(OFF_Q + i·GP) is
        the byte address of s_q[i, 0] (a per-group register plus an immediate, folded into the LDS)."""
        lvl = lds_f32(s_lvl, lb | (((x >> uint32(sh)) & KMASK) << uint32(2)))
        for gq in range(GP // 4):
            qv = ld_shared_v4_f32(smem, qb + uint32(16 * gq))
            for e in range(4):
                if 4 * gq + e < G:
                    sc[4 * gq + e] += qv[e] * lvl

    @device_inline
    def key_word(s_lvl, lb, smem, x, sh0, n, qb, sc):
        """The n (8 or 10) codes of word x from bit sh0 on, at coordinates from qb's on. Written out: LLVM
        leaves a 10-trip loop of this size rolled, and the shifts and query offsets then cost registers
        and adds per code instead of immediates."""
        key_code(s_lvl, lb, smem, x, sh0, qb, sc)
        key_code(s_lvl, lb, smem, x, sh0 + k_bits, qb + uint32(QS), sc)
        key_code(s_lvl, lb, smem, x, sh0 + 2 * k_bits, qb + uint32(2 * QS), sc)
        key_code(s_lvl, lb, smem, x, sh0 + 3 * k_bits, qb + uint32(3 * QS), sc)
        key_code(s_lvl, lb, smem, x, sh0 + 4 * k_bits, qb + uint32(4 * QS), sc)
        key_code(s_lvl, lb, smem, x, sh0 + 5 * k_bits, qb + uint32(5 * QS), sc)
        key_code(s_lvl, lb, smem, x, sh0 + 6 * k_bits, qb + uint32(6 * QS), sc)
        key_code(s_lvl, lb, smem, x, sh0 + 7 * k_bits, qb + uint32(7 * QS), sc)
        if n > 8:
            key_code(s_lvl, lb, smem, x, sh0 + 8 * k_bits, qb + uint32(8 * QS), sc)
            key_code(s_lvl, lb, smem, x, sh0 + 9 * k_bits, qb + uint32(9 * QS), sc)

    @device_inline
    def key_group(s_lvl, lb, smem, x0, x1, x2, x3, qb, sc):
        """32 codes at coordinates from qb's on: three words at 3 bits (codes 10 and 21 straddle two
        words; a funnel shift joins them), four at 4 bits (x3 unused at 3 bits)."""
        if k_bits == 4:
            key_word(s_lvl, lb, smem, x0, 0, 8, qb, sc)
            key_word(s_lvl, lb, smem, x1, 0, 8, qb + uint32(8 * QS), sc)
            key_word(s_lvl, lb, smem, x2, 0, 8, qb + uint32(16 * QS), sc)
            key_word(s_lvl, lb, smem, x3, 0, 8, qb + uint32(24 * QS), sc)
        else:
            key_word(s_lvl, lb, smem, x0, 0, 10, qb, sc)
            key_code(s_lvl, lb, smem, funnel(x1, x0, 30), 0, qb + uint32(10 * QS), sc)
            key_word(s_lvl, lb, smem, x1, 1, 10, qb + uint32(11 * QS), sc)
            key_code(s_lvl, lb, smem, funnel(x2, x1, 31), 0, qb + uint32(21 * QS), sc)
            key_word(s_lvl, lb, smem, x2, 2, 10, qb + uint32(22 * QS), sc)

    @device_inline
    def key_block(s_lvl, lb, smem, kw, qb, sc):
        """The block's CPB codes from kw[0:KB]: one group, or four at 3 bits with 16-byte loads (written
        out, so kw's indices stay constants and kw stays in registers)."""
        if k_bits == 4:
            key_group(s_lvl, lb, smem, kw[0], kw[1], kw[2], kw[3], qb, sc)
        else:
            key_group(s_lvl, lb, smem, kw[0], kw[1], kw[2], uint32(0), qb, sc)
            if KB == 12:
                key_group(s_lvl, lb, smem, kw[3], kw[4], kw[5], uint32(0), qb + uint32(32 * QS), sc)
                key_group(s_lvl, lb, smem, kw[6], kw[7], kw[8], uint32(0), qb + uint32(64 * QS), sc)
                key_group(s_lvl, lb, smem, kw[9], kw[10], kw[11], uint32(0), qb + uint32(96 * QS), sc)

    @device_inline
    def load_block(k_words, at, kw):
        """kw[0:KB] = the KB key words from flat word index at (16-byte aligned when V4)."""
        if V4:
            for u in range(KB // 4):
                a, b, c, e = ldg_nc_v4_u32(k_words, at + uint32(4 * u))
                kw[4 * u] = a
                kw[4 * u + 1] = b
                kw[4 * u + 2] = c
                kw[4 * u + 3] = e
        else:
            for u in range(KB):
                kw[u] = k_words[at + uint32(u)]

    @device_inline
    def value_bits(v_words, row, wa, wb, vsh, grp):
        """The 8·v_bits code bits of my group of value row ``row`` (decode.py's group_bits, with the
        lane's word offsets and shift computed once)."""
        base = uint32(row * uint32(WV))
        if v_bits == 4:
            return v_words[uint32(base + grp)]
        return funnel(v_words[uint32(base + wb)], v_words[uint32(base + wa)], vsh)

    @device_inline
    def value_token(s_lvl, lbv, smem, bits, pslot, acc):
        """acc[8g + k] += w[g] · level(code k of bits), w the token's weights at word pslot of s_p."""
        lv = cuda.local.array(8, float32)
        for k in range(8):
            lv[k] = lds_f32(s_lvl, lbv | (((bits >> uint32(v_bits * k)) & VMASK) << uint32(2)))
        for gq in range(GP // 4):
            wv = ld_shared_v4_f32(smem, uint32(4) * (pslot + uint32(4 * gq)))
            for e in range(4):
                if 4 * gq + e < G:
                    for k in range(8):
                        acc[8 * (4 * gq + e) + k] += wv[e] * lv[k]

    @device_inline
    def value_batch(v_words, r_first, last, wa, wb, vsh, grp, nb):
        """nb[0:VB] = my value bits of rows r_first .. r_first + VB - 1 (clamped to the split's last)."""
        for t in range(VB):       # uint32(...) everywhere: numba widens uint32 sums to 64 bits
            nb[t] = value_bits(v_words, uint32(min(uint32(r_first + uint32(t)), last)), wa, wb, vsh, grp)

    @cached_jit(pdl=True, **occupancy)
    def partial(q, k_words, k_norms, v_words, v_norms, kv_len, k_signs, k_levels, v_levels, v_signs, part_o,
                part_ml, k_flat, v_flat):
        griddep_wait()                                    # kernels/pdl.py: before any global access
        griddep_launch_dependents()                       # the combine may be scheduled; it waits for us
        smem = cuda.shared.array(0, float32, alignment=16)
        # the codebooks, 64-byte aligned, so a code's byte offset ORs into the base (one LOP3 with the mask)
        s_lvl = cuda.shared.array(16, float32, alignment=64)
        s_vlvl = cuda.shared.array(16, float32, alignment=64)
        lb = smem_u32(s_lvl)
        lbv = smem_u32(s_vlvl)
        split, hk, tid, w, lane, max_seq, n_kv, per = place(kv_len, k_norms)
        if split * per >= n_kv:
            return
        rot = cuda.local.array(V, float32)
        for i in range(tid, d * GP, TPB):                 # the padding heads of s_q are zeros
            smem[OFF_Q + i] = f0
        cuda.syncthreads()
        for g in range(w, G, NW):                         # s_q [d, GP]: queries · signs, rotated by warps
            rotate_query(q, hk * G + g, k_signs, rot, V, lane)
            for k in range(V):
                smem[OFF_Q + (V * lane + k) * GP + g] = rot[k]
        if tid < 16:
            s_lvl[tid] = k_levels[tid] if tid < k_levels.shape[0] else f0
            s_vlvl[tid] = v_levels[tid] if tid < v_levels.shape[0] else f0
        cuda.syncthreads()
        grp = uint32(min(lane, LANES - 1))                # my value group (lanes past LANES mirror the last)
        wa = (uint32(3) * grp) >> uint32(2)               # its words and shift at 3 bits (decode.py)
        wb = min(wa + uint32(1), uint32(WV - 1))
        vsh = uint64((uint32(24) * grp) & uint32(31))
        m = cuda.local.array(G, float32)                  # running maximum (log2 domain), same in all lanes
        lsum = cuda.local.array(G, float32)               # my tokens' share of the softmax sum
        acc = cuda.local.array(R8, float32)               # [G, 8] unnormalised output at my coordinates
        sc = cuda.local.array(G, float32)                 # my token's scores
        kw = cuda.local.array(KB, uint32)                 # a block of my key row's words
        cur = cuda.local.array(VB, uint32)                # value bits of the batch being summed
        nxt = cuda.local.array(VB, uint32)                # and of the next batch, in flight
        for g in range(G):
            m[g] = NEG_INF
            lsum[g] = f0
        for x in range(R8):
            acc[x] = f0
        j_end = min(n_kv, (split + 1) * per)
        row0 = uint32(hk * max_seq)                       # rows < Hkv·max_seq < 2^32: uint32 arithmetic
        last = row0 + uint32(j_end - 1)
        pbase = uint32(OFF_P + w * TILE * GP)             # this warp's s_p [32, GP]
        for c0 in range(split * per + TILE * w, j_end, TILE * NW):      # warp-uniform
            r_c = row0 + uint32(c0)
            value_batch(v_words, r_c, last, wa, wb, vsh, grp, cur)      # in flight during the keys
            row = min(r_c + uint32(lane), last)           # my token (tokens past j_end: the last, masked)
            kn, _ = h2_to_f32(uint32(k_flat[row]))
            vn, _ = h2_to_f32(uint32(v_flat[row]))
            for g in range(G):
                sc[g] = f0
            kat = row * uint32(WK)
            for blk in range(NB):
                load_block(k_words, kat + uint32(KB * blk), kw)
                key_block(s_lvl, lb, smem, kw, uint32(4 * OFF_Q + CPB * QS * blk), sc)
            valid = c0 + lane < j_end
            syncwarp()                                    # the previous tile's weights are all read
            for g in range(G):                            # online softmax of head g over the tile
                score = sc[g] * kn * SCORE if valid else NEG_INF
                mx = score
                for sh in (16, 8, 4, 2, 1):
                    mx = max(mx, shfl_xor_f32(mx, sh))
                raise_max(m, lsum, acc, g, mx)            # warp-uniform
                p = math.exp2(score - m[g])
                lsum[g] += p
                smem[pbase + uint32(lane * GP + g)] = p * vn * INV_SQRT_D if valid else f0
            syncwarp()
            for b in range(TILE // VB):
                if b + 1 < TILE // VB:                    # fetch the next batch before summing this one
                    value_batch(v_words, r_c + uint32(VB * (b + 1)), last, wa, wb, vsh, grp, nxt)
                for t in range(VB):
                    value_token(s_vlvl, lbv, smem, cur[t], pbase + uint32((VB * b + t) * GP), acc)
                for t in range(VB):
                    cur[t] = nxt[t]
        for g in range(G):                                # the softmax sums over the warp's lanes
            for sh in (16, 8, 4, 2, 1):
                lsum[g] += shfl_xor_f32(lsum[g], sh)
        tail(smem, acc, m, lsum, rot, lane, w, tid, split, hk, part_o, part_ml, v_signs)

    return partial, split_combine_kernel(d, n_splits, STEP, gated)
