"""Quantize-on-append for the 3/4-bit KV cache: kvq/ref.py's ``quantize`` and ``pack`` for the keys or values
of T new tokens, written at their cache positions.

``row_coder`` codes one vector with a block of any power-of-two size from 32; the model's keys and values
are coded by the QK-norm + RoPE kernel that makes them (flash_attn/rope.py given a coded cache: 64 threads,
no float16 copy, no launch of its own), from their float16 rounding, as a float16 cache would hold them.
``kvq_append`` codes float32 rows, one block per (token, KV head), one thread per coordinate (max(32, d)
threads, d a power of two <= 1024):
  1. x ⊙ s into shared memory; the squared norm summed in float64 (the reference's norm, to the f16 rounding)
  2. the Walsh-Hadamard butterflies, log2(d) stages in the reference's order, each thread on its own
     coordinates in registers: shuffles within a warp, shared memory (two barriers) between warps
  3. n = ||x|| rounded to float16 (stored as its bits); y_i = (H(s ⊙ x))_i / sqrt(d) · sqrt(d) / n, the
     unit-variance coordinate, and its code = the number of Lloyd-Max thresholds below it (searchsorted:
     a count over the thresholds held in registers at 3 and 4 bits, a bisection of 8 steps at 8)
  4. the codes packed as the reference packs them (8 bits: one per byte; 4 bits: two per byte, low nibble
     first; 3 bits: each group of 8 codes in 3 bytes), one byte per thread
A block of 64 (the rope kernel's, d = 256) meets 5 barriers; the first version, a tree in shared memory
with a barrier per stage and 64-bit loop arithmetic, 11, and took the rope kernel from 3.7 to 10.8 µs (H200,
9B decode step at depth 32K, benchmarks/NOTES.md session 21).
The rotation runs in float32 against the reference's float64: a coordinate within float32 rounding of a
threshold can take the neighbouring code (tests/kernels/test_kvq_append.py bounds where).

Buffers: x [T, Hkv, d] f32 (this step's keys or values); signs [d] f32 (±1, ref.hadamard_signs);
thresholds [2^bits - 1] f32 (ref.lloyd_max_gaussian); codes [Hkv, max_seq, d·bits/8] uint8 and norms
[Hkv, max_seq] uint16 (float16 bits), written at positions pos[0] .. pos[0] + T - 1 (pos: [1] int32 on the
device, so that a captured decode step appends where the sequence is).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import float32, float64, int32, uint8, uint16, uint32

from ninfer_numba.kernels.flash_attn.decode import h2_to_f32
from ninfer_numba.kernels.flash_attn.mma_f16 import pack_f16x2
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.ref import BITS, hadamard_signs, lloyd_max_gaussian
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.ptx import shfl_xor_f32, shfl_xor_f64

F16_TINY = float(np.finfo(np.float16).tiny)          # the reference's floor on the norm


@lru_cache(maxsize=None)
def row_coder(d: int, bits: int, nthreads: int):
    """(scratch, code_row) device functions coding one vector of d coordinates by a block of nthreads:
    scratch() -> the shared arrays (s_y [d] f32, s_ss [d] f64, s_c [d] uint8, s_w [32] f64), made once per
    kernel; code_row(sh, thresholds, codes, norms, h, row, tid) codes s_y = x ⊙ s with s_ss = x² into
    codes[h, row] and norms[h, row] (steps 2-4 of the module docstring). Thread tid owns coordinates
    tid + nthreads·c (c < max(1, d / nthreads)) and must have put them itself (put_exact): no barrier
    before. The butterflies run in the order of the reference (half = 1, 2, 4, ...), whatever holds the
    pair: shuffles within a warp (half < 32), shared memory between warps, registers within a thread
    (half >= nthreads); so any block size codes bit-identically. Refuses unsupported shapes."""
    if d & (d - 1) or not 2 <= d <= 1024 or bits not in BITS or (d * bits) % 24 and bits == 3:
        raise ValueError(f"unsupported kvq append: d={d} (a power of two <= 1024), bits={bits}")
    if nthreads & (nthreads - 1) or not 32 <= nthreads <= 1024:
        raise ValueError(f"row_coder needs a power-of-two block of 32 to 1024 threads (got {nthreads})")
    NB = d * bits // 8                 # bytes of codes per vector
    SQRT_D = float32(math.sqrt(d))
    NT = nthreads
    COORDS = max(1, d // NT)           # coordinates per thread
    SHFL_END = min(32, d)              # butterflies of half < this: shuffles
    SMEM_END = min(NT, d)              # then up to this: shared memory; then registers
    NWARP = NT // 32
    PACK_ROUNDS = (NB + NT - 1) // NT
    # 3 and 4 bits: the 7 or 15 thresholds are read into registers first (their loads overlap the
    # butterflies) and a code counts those below y; 8 bits bisects the 255 in memory
    NTH = (1 << bits) - 1 if bits <= 4 else 1

    @cuda.jit(device=True, inline=True)
    def scratch():
        s_y = cuda.shared.array(d, float32)          # one per line: the simulator tells them apart by line
        s_ss = cuda.shared.array(d, float64)
        s_c = cuda.shared.array(d, uint8)
        s_w = cuda.shared.array(32, float64)         # the warps' sums of squares
        return s_y, s_ss, s_c, s_w

    @cuda.jit(device=True, inline=True)
    def code_row(sh, thresholds, codes, norms, h, row, tid):
        s_y, s_ss, s_c, s_w = sh
        th = cuda.local.array(NTH, float32)          # [2^bits - 1] the thresholds at 3 and 4 bits
        if bits <= 4:
            for k in range(NTH):
                th[k] = thresholds[k]
        v = cuda.local.array(COORDS, float32)        # my coordinates tid + NT·c (registers: c unrolls)
        ss = float64(0.0)
        for c in range(COORDS):
            i = tid + NT * c
            v[c] = s_y[i] if i < d else float32(0.0)
            ss += s_ss[i] if i < d else float64(0.0)
        half = 1
        while half < SHFL_END:                       # partner lane tid ^ half: u + v below, u - v above
            upper = (tid & half) != 0
            for c in range(COORDS):
                other = shfl_xor_f32(v[c], half)
                v[c] = other - v[c] if upper else v[c] + other
            half *= 2
        while half < SMEM_END:                       # partner thread in another warp
            for c in range(COORDS):
                s_y[tid + NT * c] = v[c]
            cuda.syncthreads()
            upper = (tid & half) != 0
            for c in range(COORDS):
                other = s_y[(tid ^ half) + NT * c]
                v[c] = other - v[c] if upper else v[c] + other
            cuda.syncthreads()
            half *= 2
        hc = 1
        while hc < COORDS:                           # partner coordinate c ^ hc in my own registers
            for c in range(COORDS):
                if c & hc == 0:
                    a = v[c]
                    b = v[c + hc]
                    v[c] = a + b
                    v[c + hc] = a - b
            hc *= 2
        for k in range(5):                           # the sum of squares: warp, then warps in order
            ss += shfl_xor_f64(ss, 1 << k)
        if tid & 31 == 0:
            s_w[tid >> 5] = ss
        cuda.syncthreads()
        total = float64(0.0)
        for w in range(NWARP):
            total += s_w[w]
        n16_bits = pack_f16x2(float32(math.sqrt(total)), float32(0.0)) & uint32(0xFFFF)
        n16, _ = h2_to_f32(n16_bits)
        scale = SQRT_D / max(n16, float32(F16_TINY))
        for c in range(COORDS):
            i = tid + NT * c
            y = v[c] / SQRT_D * scale
            q = int32(0)                               # thresholds below y (they are sorted)
            if bits <= 4:
                for k in range(NTH):
                    q += int32(th[k] < y)
            else:                                      # by bisection
                for k in range(bits):
                    half_span = int32(1) << int32(bits - 1 - k)
                    if thresholds[q + half_span - 1] < y:
                        q += half_span
            if i < d:
                s_c[i] = uint8(q)
        if tid == 0:
            norms[h, row] = uint16(n16_bits)
        cuda.syncthreads()
        for r in range(PACK_ROUNDS):
            b = tid + NT * r
            if b < NB:
                if bits == 8:
                    byte = s_c[b]
                elif bits == 4:
                    byte = s_c[2 * b] | (s_c[2 * b + 1] << 4)
                else:
                    g = b // 3
                    word = uint32(0)
                    for k in range(8):
                        word |= uint32(s_c[8 * g + k]) << uint32(3 * k)
                    byte = (word >> uint32(8 * (b - 3 * g))) & uint32(0xFF)
                codes[h, row, b] = uint8(byte)
        cuda.syncthreads()                             # the scratch is free again

    return scratch, code_row


@cuda.jit(device=True, inline=True)
def put_exact(sh, signs, i, x):
    """Coordinate i of a vector to code (step 1 of the module docstring): x times the sign, and its square."""
    s_y, s_ss = sh[0], sh[1]
    s_y[i] = x * signs[i]
    s_ss[i] = float64(x) * float64(x)


@cuda.jit(device=True, inline=True)
def put_coordinate(sh, signs, i, x):
    """put_exact of x rounded to float16 (what an f16 cache would hold)."""
    xv, _ = h2_to_f32(pack_f16x2(x, float32(0.0)) & uint32(0xFFFF))
    put_exact(sh, signs, i, xv)


def append_threads(d: int) -> int:
    """kvq_append's block: a thread per coordinate, whole warps (the butterflies shuffle)."""
    return max(32, d)


@lru_cache(maxsize=None)
def _append_kernel(d: int, bits: int):
    scratch, code_row = row_coder(d, bits, append_threads(d))

    @cached_jit()
    def append(x, signs, thresholds, codes, norms, pos):
        # x: [T, Hkv, d] f32; signs: [d] f32; thresholds: [2^bits - 1] f32; codes: [Hkv, max_seq, d·bits/8]
        # u8; norms: [Hkv, max_seq] u16 (f16 bits); pos: [1] int32
        sh = scratch()
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        i = cuda.threadIdx.x
        if i < d:
            put_exact(sh, signs, i, x[t, h, i])
        code_row(sh, thresholds, codes, norms, h, pos[0] + t, i)

    return append


class KvqTables:
    """Device copies of one cache role's constants: the rotation signs and the codebook's thresholds."""

    def __init__(self, d: int, bits: int, seed: int, stream=0) -> None:
        self.d, self.bits, self.seed = d, bits, seed
        levels, thresholds, _ = lloyd_max_gaussian(bits)
        self.signs = cuda.to_device(hadamard_signs(d, seed).astype(np.float32), stream=stream)     # [d]
        self.thresholds = cuda.to_device(thresholds.astype(np.float32), stream=stream)             # [2^b - 1]
        self.levels = cuda.to_device(levels.astype(np.float32), stream=stream)                     # [2^b]

    def role(self, codes, norms) -> tuple:
        """(codes, norms, signs, thresholds): one coded cache of this role as the QK-norm + RoPE kernel
        takes it in place of a float16 cache (flash_attn/rope.py), coding what it stores."""
        return codes, norms, self.signs, self.thresholds


def kvq_append(x, tables: KvqTables, codes, norms, pos, stream=0) -> None:
    """Quantize x [T, Hkv, d] float32 into codes [Hkv, max_seq, d·bits/8] uint8 and norms [Hkv, max_seq]
    uint16 (float16 bits) at positions pos[0] .. pos[0] + T - 1 (pos: [1] int32, device)."""
    T, Hkv, d = x.shape
    kernel = _append_kernel(d, tables.bits)            # refuses unsupported shapes
    if d != tables.d or codes.shape[2] != d * tables.bits // 8:
        raise ValueError(f"x rows of {d} and cache rows of {codes.shape[2]} bytes do not fit tables "
                         f"(d={tables.d}, bits={tables.bits})")
    if T:
        kernel[(T, Hkv), append_threads(d), stream](x, tables.signs, tables.thresholds, codes, norms, pos)
