"""fp16 tensor-core intrinsics for the attention prefill kernel, each with a pure-Python twin for the simulator.

On a GPU every name below is an ``@intrinsic`` emitting one PTX instruction (pattern: reference/numba-cuda.md
§2, as in kernels/ptx.py):

- ``mma_f16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)``: warp-wide
  ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``, D = A·B + C, returns (d0, d1, d2, d3) float32.
- ``pack_f16x2(lo, hi)``: two float32 rounded to nearest f16 and packed into one uint32, ``lo`` in bits
  0-15 (``cvt.rn.f16x2.f32``, whose FIRST source lands in the UPPER half, so the operands are swapped).

Fragment layouts (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type"; g = lane >> 2,
t = lane & 3; each b32 register holds two f16, the lower-indexed element in the low half):

    A 16x16 row:  a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]   a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
    B 16x8 col:   b0 = B[2t:2t+2, g]   b1 = B[2t+8:2t+10, g]
    C/D 16x8:     c0 = C[g, 2t]  c1 = C[g, 2t+1]  c2 = C[g+8, 2t]  c3 = C[g+8, 2t+1]

kernels/ptx.py's ldmatrix_x4 gives lane (g, t) the pair M[g, 2t:2t+2] of each 8x8 matrix M (rows = the addressed rows), or with
``.trans`` the pair (M[2t, g], M[2t+1, g]); with row addresses chosen accordingly the four registers are an
A fragment of a row-major tile, B fragments of a row-major [n, k] tile (K rows), or, transposed, B
fragments of a row-major [k, n] tile (V rows).

Under ``NUMBA_ENABLE_CUDASIM=1`` the twins exchange values among the 32 simulated lanes of a warp with
kernels/ptx.py's per-warp barrier, so the whole kernel runs (slowly) in the simulator at tiny shapes.
"""
import numpy as np
from llvmlite import ir
from numba import types

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.ptx import mma_sync_f32_intrinsic
from ninfer_numba.kernels.ptx_sim import mma_sync_f32_twin

_I32 = ir.IntType(32)
_F32 = ir.FloatType()


# ---------------------------------------------------------------- GPU: inline PTX ---------------------

def _make_intrinsics():
    from numba.cuda.extending import intrinsic

    mma_f16_16816 = mma_sync_f32_intrinsic("m16n8k16.row.col.f32.f16.f16.f32")

    @intrinsic
    def pack_f16x2(typingctx, lo, hi):
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
            fn = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]), "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")
            return builder.call(fn, vals)
        return sig, codegen

    return mma_f16_16816, pack_f16x2


# ---------------------------------------------------------------- simulator: Python twins -------------

def _f16_pairs(words):
    """uint32 words -> [n, 2] float64 of the (low, high) f16 halves."""
    w = np.asarray([int(x) & 0xFFFFFFFF for x in words], np.uint32)
    return w.view(np.float16).reshape(-1, 2).astype(np.float64)


def _make_fallbacks():
    mma_f16_16816 = mma_sync_f32_twin(_f16_pairs, 2)

    @cuda.jit(device=True)
    def pack_f16x2(lo, hi):
        with np.errstate(over="ignore"):                        # overflow to inf, as cvt.rn does
            return np.array([lo, hi], np.float32).astype(np.float16).view(np.uint32)[0]

    return mma_f16_16816, pack_f16x2


mma_f16_16816, pack_f16x2 = _make_fallbacks() if SIMULATOR else _make_intrinsics()


@cuda.jit(device=True, inline=True)
def mma_into(acc, x, a0, a1, a2, a3, b0, b1):
    """acc[x:x+4], one 16x8 float32 C fragment in a local array, += A·B (m16n8k16, f16 operands)."""
    acc[x], acc[x + 1], acc[x + 2], acc[x + 3] = mma_f16_16816(a0, a1, a2, a3, b0, b1, acc[x], acc[x + 1],
                                                               acc[x + 2], acc[x + 3])
