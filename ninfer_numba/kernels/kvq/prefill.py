"""Prefill attention over the coded cache (3, 4 or 8 bits), on fp16 tensor cores, in the rotated domain.

The float16 prefill kernel (flash_attn/prefill_mma.py) with two hooks swapped, so no float16 copy of the
history exists anywhere (a prefill at depth L reads L·(k_bits + v_bits)/8 bytes per KV head coordinate,
not 4·L, and needs no [Hkv, L, d] scratch):

  1. ``rotate_rows``: the queries q [T, H, d] (float16, in place) become R_k q = H(s_k ⊙ q)/√d, the
     domain the key codes live in (q·k = (R_k q)·(R_k k): kvq/ref.py). One block per (token, head), one
     thread per coordinate, the butterflies in shared memory.
  2. The mma kernel, whose K and V tiles are decoded from the codes into shared memory as float16
     level[c] · n/√d (the rotated vectors kvq/ref.py's ``decode_rotated`` gives), BK rows at a time: each
     thread one group of 8 codes (3 bytes at 3 bits, 4 at 4, 8 at 8) → 4 words of f16 pairs, one norm read.
     The tile loads are plain stores where the f16 kernel's are cp.async: they do not overlap the tile's
     mma work (a cost to measure; the norm and codebook reads hit L1).
  3. Its epilogue: O/l [BQ, d] (in the values' rotated domain) gets the Walsh-Hadamard butterflies per row
     in shared memory, then out = s_v ⊙ (H o)/√d ⊙ σ(gate) = R_vᵀ o ⊙ σ(gate).

Buffers: q [T, H, d] float16 (rotated in place); k_codes [Hkv, max_seq, d·k_bits/8] uint8, k_norms
[Hkv, max_seq] uint16 (float16 bits), likewise v; rows < pos0 + T hold the sequence's keys and values (this
forward's rows appended already); pos0_buf [1] int32; proj [T, 2·d·H + 2·d·Hkv] float32 (the gates);
out [T, H·d] float32.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import float32, uint32

from ninfer_numba.kernels.flash_attn.decode import h2_to_f32
from ninfer_numba.kernels.flash_attn.mma_f16 import pack_f16x2
from ninfer_numba.kernels.flash_attn.prefill_mma import (BK, MAX_D, N_WARPS, TileShape, gated_finish,
                                                        launch_kernel, supports_shape, zero_words)
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.numba_env import cuda


@cuda.jit(device=True)
def fwht_rows(s_x, off, rows, d, stride, tid, nthreads):
    """In-place Walsh-Hadamard butterflies of ``rows`` rows of d floats at s_x[off + r·stride:] (d a power of
    two), by a block of nthreads (a barrier after each of the log2(d) rounds). Index arithmetic by shifts on
    uint32: a division by the round's stride was two 64-bit divisions per butterfly."""
    lg_half = uint32(0)                                   # log2(d / 2)
    while (uint32(2) << lg_half) < uint32(d):
        lg_half += uint32(1)
    lg = uint32(0)
    while (uint32(1) << lg) < uint32(d):
        half = uint32(1) << lg
        for e in range(tid, rows * (d // 2), nthreads):
            p = uint32(e)
            r = p >> lg_half
            p -= r << lg_half
            a = uint32(off) + r * uint32(stride) + ((p >> lg) << (lg + uint32(1))) + (p & (half - uint32(1)))
            u = s_x[a]
            v = s_x[a + half]
            s_x[a] = u + v
            s_x[a + half] = u - v
        cuda.syncthreads()
        lg += uint32(1)


@lru_cache(maxsize=None)
def _rotate_kernel(d: int):
    INV_SQRT_D = float32(1.0 / math.sqrt(d))

    @cached_jit()
    def rotate(x, signs):
        # x: [T, H, d] float16, rotated in place; signs: [d] float32
        s_x = cuda.shared.array(d, float32)
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        i = cuda.threadIdx.x
        s_x[i] = float32(x[t, h, i]) * signs[i]
        cuda.syncthreads()
        fwht_rows(s_x, 0, 1, d, d, i, d)
        x[t, h, i] = s_x[i] * INV_SQRT_D

    return rotate


def rotate_rows(x, tables: KvqTables, stream=0) -> None:
    """x [T, H, d] float16 ← R x = H(s ⊙ x)/√d per row, in place (s: the tables' signs)."""
    T, H, d = x.shape
    if d != tables.d or d & (d - 1) or d > 1024:
        raise ValueError(f"rows of {d} for tables of d={tables.d} (a power of two <= 1024)")
    if T:
        _rotate_kernel(d)[(T, H), d, stream](x, tables.signs)


def coded_cache_hooks(ts: TileShape, k_bits: int, v_bits: int):
    """(head_base, load_k, load_v, finish) of prefill_mma's kernel over a coded cache: k_cache is the tuple
    (k codes, k norms, k levels), v_cache (v codes, v norms, v levels, v signs); head_base is the KV head
    itself; tiles decoded from the codes; the output rotated back and gated."""
    D, TPB, RW, OW, BQ = ts.D, ts.TPB, ts.RW, ts.OW, ts.BQ
    GROUPS = D // 8                      # groups of 8 codes per row, 4 f16-pair words each
    ITERS = (BK * GROUPS + TPB - 1) // TPB
    INV_SQRT_D = float32(1.0 / math.sqrt(D))
    zero = uint32(0)

    @cuda.jit(device=True, inline=True)
    def head_base(src, kvh):
        return kvh

    def tile_loader(bits: int):
        FIELD = uint32(bits)             # a code's bits in the group's little-endian word
        MASK = uint32((1 << bits) - 1)
        GROUP_BYTES = bits               # 8 codes of `bits` bits

        @cuda.jit(device=True, inline=True)
        def load(smem, off, src, kvh, kt0, kv_hi):
            """Rows kt0..kt0+BK-1 of KV head kvh decoded into smem[off:] as f16 pairs; rows at or past kv_hi
            zero-filled."""
            codes, norms, levels = src[0], src[1], src[2]
            tid = cuda.threadIdx.x
            for i in range(ITERS):
                e = tid + i * TPB
                r = e // GROUPS
                gi = e - r * GROUPS
                dst = off + r * RW + 4 * gi
                row = kt0 + r
                if r < BK:
                    if row < kv_hi:
                        n, _ = h2_to_f32(uint32(norms[kvh, row]))
                        scale = n * INV_SQRT_D
                        b = GROUP_BYTES * gi
                        if bits == 8:                      # a byte per code
                            for w in range(4):
                                lo = codes[kvh, row, b + 2 * w]
                                hi = codes[kvh, row, b + 2 * w + 1]
                                smem[dst + w] = pack_f16x2(levels[lo] * scale, levels[hi] * scale)
                        else:                              # the group's 24 or 32 bits in one word
                            word = zero
                            for k in range(GROUP_BYTES):
                                word |= uint32(codes[kvh, row, b + k]) << uint32(8 * k)
                            for w in range(4):
                                lo = (word >> (FIELD * uint32(2 * w))) & MASK
                                hi = (word >> (FIELD * uint32(2 * w + 1))) & MASK
                                smem[dst + w] = pack_f16x2(levels[lo] * scale, levels[hi] * scale)
                    else:
                        zero_words(smem, dst)

        return load

    # the epilogue: out = R_vᵀ (O/l) ⊙ σ(gate), the butterflies on the staged rows, then signs / √d
    @cuda.jit(device=True, inline=True)
    def rotate_back(smem_f, v_src, tid):
        fwht_rows(smem_f, 0, BQ, D, OW, tid, TPB)

    @cuda.jit(device=True, inline=True)
    def signs_over_sqrt_d(v_src, c):
        return v_src[3][c] * INV_SQRT_D

    return head_base, tile_loader(k_bits), tile_loader(v_bits), gated_finish(ts, rotate_back, signs_over_sqrt_d)


def kvq_attention_prefill(q, k_codes, k_norms, v_codes, v_norms, pos0_buf, k_tab: KvqTables, v_tab: KvqTables,
                          proj, out, *, stream=0, n_warps: int = N_WARPS) -> None:
    """Gated causal attention of T queries at positions pos0..pos0+T-1 over coded cache rows [0, pos0+T)
    (module docstring for the buffers). q is left rotated."""
    T, H, D = q.shape
    Hkv = k_codes.shape[0]
    if not supports_shape(H, Hkv, D) or D & (D - 1) or n_warps not in (4, 8):
        raise ValueError(f"unsupported coded prefill shape H={H} Hkv={Hkv} d={D} n_warps={n_warps} "
                         f"(d a power of two, 16 <= d <= {MAX_D}, H % Hkv == 0)")
    for tab, codes in ((k_tab, k_codes), (v_tab, v_codes)):
        if tab.d != D or codes.shape[2] != D * tab.bits // 8:
            raise ValueError(f"cache rows of {codes.shape[2]} bytes and queries of d={D} do not fit tables "
                             f"(d={tab.d}, bits={tab.bits})")
    if T == 0:
        return
    rotate_rows(q, k_tab, stream=stream)
    launch_kernel(Hkv, n_warps, (k_tab.bits, v_tab.bits), (q, (k_codes, k_norms, k_tab.levels),
                  (v_codes, v_norms, v_tab.levels, v_tab.signs), pos0_buf, proj, out), stream)
