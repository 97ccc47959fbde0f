"""The 3/4-bit cache decoded back to float16 rows (kvq/ref.py's dequantize), for the prefill attention: a
prefill chunk attends to every cached row with the f16 tensor-core kernel, which reads the decoded rows from
one scratch cache shared by the layers (decode never decodes: kvq/decode.py works in the rotated domain).

One block per (row, KV head) of a fixed grid striding over rows < kv_len[0] (read on the device, so that a
captured prefill graph decodes as far as the sequence has reached); one thread per coordinate: level[code]
· n / sqrt(d), the Walsh-Hadamard butterflies in shared memory, · signs / sqrt(d), rounded to float16.

Buffers: codes [Hkv, max_seq, d·bits/8] uint8; norms [Hkv, max_seq] uint16 (float16 bits); kv_len [1]
int32; out [Hkv, max_seq, d] uint16 (the float16 scratch cache viewed as its bits), rows < kv_len written.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import float32, uint32, uint16

from ninfer_numba.kernels.flash_attn.decode import h2_to_f32
from ninfer_numba.kernels.flash_attn.mma_f16 import pack_f16x2
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

ROW_BLOCKS = 64 if SIMULATOR else 2048          # blocks along the rows (each strides over the rest)


@cuda.jit(device=True)
def fwht_rows(s_x, off, rows, d, tid, nthreads):
    """In-place Walsh-Hadamard butterflies of each of ``rows`` rows of d floats at s_x[off:] (d a power of
    two), by a block of nthreads (barriers included). Index arithmetic by shifts on uint32: a division by the
    round's stride was two 64-bit divisions per butterfly."""
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
            a = uint32(off) + r * uint32(d) + ((p >> lg) << (lg + uint32(1))) + (p & (half - uint32(1)))
            u = s_x[a]
            v = s_x[a + half]
            s_x[a] = u + v
            s_x[a + half] = u - v
        cuda.syncthreads()
        lg += uint32(1)


@lru_cache(maxsize=None)
def _dequant_kernel(d: int, bits: int):
    INV_SQRT_D = float32(1.0 / math.sqrt(d))

    @cached_jit()
    def dequant(codes, norms, signs, levels, kv_len, out):
        s_x = cuda.shared.array(d, float32)
        h = cuda.blockIdx.y
        i = cuda.threadIdx.x
        n_rows = kv_len[0]
        for r in range(cuda.blockIdx.x, n_rows, cuda.gridDim.x):     # block-uniform
            if bits == 4:
                c = (uint32(codes[h, r, i // 2]) >> uint32(4 * (i % 2))) & uint32(15)
            else:
                g = 3 * (i // 8)
                word = (uint32(codes[h, r, g]) | (uint32(codes[h, r, g + 1]) << uint32(8))
                        | (uint32(codes[h, r, g + 2]) << uint32(16)))
                c = (word >> uint32(3 * (i % 8))) & uint32(7)
            n, _ = h2_to_f32(uint32(norms[h, r]))
            s_x[i] = levels[c] * n * INV_SQRT_D
            cuda.syncthreads()
            fwht_rows(s_x, 0, 1, d, i, d)
            out[h, r, i] = uint16(pack_f16x2(s_x[i] * signs[i] * INV_SQRT_D, float32(0.0)) & uint32(0xFFFF))
            cuda.syncthreads()                                        # s_x is reused by the next row

    return dequant


def kvq_dequantize(codes, norms, tables: KvqTables, kv_len, out_u16, stream=0) -> None:
    """Rows < kv_len[0] of the coded cache into out_u16 [Hkv, max_seq, d] (float16 bits)."""
    Hkv, _, d = out_u16.shape
    _dequant_kernel(d, tables.bits)[(ROW_BLOCKS, Hkv), d, stream](codes, norms, tables.signs, tables.levels,
                                                                  kv_len, out_u16)
