"""Quantize-on-append for the 3/4-bit KV cache: kvq/ref.py's ``quantize`` and ``pack`` for the keys or values
of T new tokens, written at their cache positions.

One block per (token, KV head), one thread per coordinate (d threads, d a power of two <= 1024):
  1. x ⊙ s into shared memory; the squared norm summed in float64 (the reference's norm, to the f16 rounding)
  2. the Walsh-Hadamard butterflies in place, log2(d) stages, one barrier each
  3. n = ||x|| rounded to float16 (stored as its bits); y_i = (H(s ⊙ x))_i / sqrt(d) · sqrt(d) / n, the
     unit-variance coordinate, and its code = the number of Lloyd-Max thresholds below it (searchsorted)
  4. the codes packed as the reference packs them (4 bits: two per byte, low nibble first; 3 bits: each
     group of 8 codes in 3 bytes), one byte per thread
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

F16_TINY = float(np.finfo(np.float16).tiny)          # the reference's floor on the norm


@lru_cache(maxsize=None)
def _append_kernel(d: int, bits: int, from_cache: bool = False):
    """from_cache: x is float16 staging rows [Hkv, >= T, d] whose row t holds new vector t (the model's
    QK-norm + RoPE kernel stores them there: its local_rows), read as float32."""
    if d & (d - 1) or not 2 <= d <= 1024 or bits not in BITS or (d * bits) % 24 and bits == 3:
        raise ValueError(f"unsupported kvq append: d={d} (a power of two <= 1024), bits={bits}")
    NB = d * bits // 8                 # bytes of codes per vector
    NT = (1 << bits) - 1               # thresholds
    SQRT_D = float32(math.sqrt(d))

    @cached_jit()
    def append(x, signs, thresholds, codes, norms, pos):
        # x: [T, Hkv, d] f32; signs: [d] f32; thresholds: [NT] f32; codes: [Hkv, max_seq, NB] u8;
        # norms: [Hkv, max_seq] u16 (f16 bits); pos: [1] int32
        s_y = cuda.shared.array(d, float32)           # x ⊙ s, then its transform
        s_ss = cuda.shared.array(d, float64)          # squares, then the tree sum
        s_c = cuda.shared.array(d, uint8)             # codes
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        i = cuda.threadIdx.x
        row = pos[0] + t
        xv = float32(x[h, t, i]) if from_cache else x[t, h, i]
        s_y[i] = xv * signs[i]
        s_ss[i] = float64(xv) * float64(xv)
        cuda.syncthreads()
        half = 1
        while half < d:                                # butterflies: thread i < d/2 owns pair (a, a + half)
            if i < d // 2:
                a = (i // half) * 2 * half + i % half
                u = s_y[a]
                v = s_y[a + half]
                s_y[a] = u + v
                s_y[a + half] = u - v
            step = d // (2 * half)                     # the norm's tree sum, one level per stage
            if i < step:
                s_ss[i] += s_ss[i + step]
            cuda.syncthreads()
            half *= 2
        n16_bits = pack_f16x2(float32(math.sqrt(s_ss[0])), float32(0.0)) & uint32(0xFFFF)
        n16, _ = h2_to_f32(n16_bits)
        y = s_y[i] / SQRT_D * (SQRT_D / max(n16, float32(F16_TINY)))
        c = int32(0)
        for k in range(NT):
            if thresholds[k] < y:
                c += 1
        s_c[i] = uint8(c)
        if i == 0:
            norms[h, row] = uint16(n16_bits)
        cuda.syncthreads()
        for b in range(i, NB, d):
            if bits == 4:
                byte = s_c[2 * b] | (s_c[2 * b + 1] << 4)
            else:
                g = b // 3
                word = uint32(0)
                for k in range(8):
                    word |= uint32(s_c[8 * g + k]) << uint32(3 * k)
                byte = (word >> uint32(8 * (b - 3 * g))) & uint32(0xFF)
            codes[h, row, b] = uint8(byte)

    return append


class KvqTables:
    """Device copies of one cache role's constants: the rotation signs and the codebook's thresholds."""

    def __init__(self, d: int, bits: int, seed: int, stream=0) -> None:
        self.d, self.bits, self.seed = d, bits, seed
        levels, thresholds, _ = lloyd_max_gaussian(bits)
        self.signs = cuda.to_device(hadamard_signs(d, seed).astype(np.float32), stream=stream)     # [d]
        self.thresholds = cuda.to_device(thresholds.astype(np.float32), stream=stream)             # [2^b - 1]
        self.levels = cuda.to_device(levels.astype(np.float32), stream=stream)                     # [2^b]


def kvq_append_from_rows(rows, T: int, tables: KvqTables, codes, norms, pos, stream=0) -> None:
    """Quantize rows 0 .. T - 1 of the float16 staging rows [Hkv, >= T, d] into codes and norms at positions
    pos[0] .. pos[0] + T - 1; see kvq_append."""
    Hkv, n_rows, d = rows.shape
    if T > n_rows:
        raise ValueError(f"{T} new rows in staging of {n_rows}")
    kernel = _append_kernel(d, tables.bits, True)
    if T:
        kernel[(T, Hkv), d, stream](rows, tables.signs, tables.thresholds, codes, norms, pos)


def kvq_append(x, tables: KvqTables, codes, norms, pos, stream=0) -> None:
    """Quantize x [T, Hkv, d] float32 into codes [Hkv, max_seq, d·bits/8] uint8 and norms [Hkv, max_seq]
    uint16 (float16 bits) at positions pos[0] .. pos[0] + T - 1 (pos: [1] int32, device)."""
    T, Hkv, d = x.shape
    kernel = _append_kernel(d, tables.bits)            # refuses unsupported shapes
    if d != tables.d or codes.shape[2] != d * tables.bits // 8:
        raise ValueError(f"x rows of {d} and cache rows of {codes.shape[2]} bytes do not fit tables "
                         f"(d={tables.d}, bits={tables.bits})")
    if T:
        kernel[(T, Hkv), d, stream](x, tables.signs, tables.thresholds, codes, norms, pos)
