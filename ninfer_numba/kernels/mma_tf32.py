"""TF32 tensor-core intrinsics with float32 accuracy by splitting ("3xTF32"), each with a simulator twin.

- ``split_tf32(x)`` -> (hi, lo) uint32 bit patterns: hi = x with its low 13 bits cleared (a tf32 value),
  lo = x - hi, exact in float32 and below 2^-10·|x|; the tensor cores read lo truncated to tf32, so hi + lo
  stands for x to 2^-20 relative. Two instructions (``and``, ``sub``): ``cvt.rna.tf32.f32`` is emulated in
  about eight on sm_90, which made the first version of the GDN kernels issue-bound on conversions.
- ``mma_tf32_1688(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)``: warp-wide
  ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``, D = A·B + C; a*/b* are tf32 bit patterns
  (uint32), c* and the returned (d0, d1, d2, d3) float32. Products of two tf32 values are exact in float32.
- ``make_mma3_tiles(n)``: A·B to about float32 accuracy for n n8 tiles as hi·hi + hi·lo + lo·hi (the lo·lo
  term, below 2^-20 relative, is dropped); ``make_a_split_ldmatrix(stride)``: split A fragments from shared
  memory by ``ldmatrix.x4``.

Used by the GDN intra-chunk solve (K Kᵀ, Q Kᵀ, the triangular inverse, W and U): the inverse of I + A
amplifies operand rounding, so those products keep float32 accuracy at three times the tensor-core work.
The state pass multiplies float16 operands instead (gdn/chunk_state_f16.py, its budget in
tests/kernels/gdn_cases.rel_budget_f16).

Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k8" with .tf32; g = lane >> 2, t = lane & 3):

    A 16x8 row:  a0 = A[g, t]    a1 = A[g+8, t]    a2 = A[g, t+4]    a3 = A[g+8, t+4]
    B 8x8 col:   b0 = B[t, g]    b1 = B[t+4, g]
    C/D 16x8:    c0 = C[g, 2t]   c1 = C[g, 2t+1]   c2 = C[g+8, 2t]   c3 = C[g+8, 2t+1]

Shared-memory operand tiles read in these patterns are conflict-free when rows read as A[g, t] (lane
address g·stride + t) have stride ≡ 4 (mod 32) words and rows read as B[t, g] (t·stride + g) have
stride ≡ 8 (mod 32).
"""
import numpy as np
from numba import types, uint32

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.ptx import i32_as_f32, ldmatrix_x4, mma_sync_f32_intrinsic, pair_asm_intrinsic
from ninfer_numba.kernels.ptx_sim import mma_sync_f32_twin



# ---------------------------------------------------------------- GPU: inline PTX ---------------------

def _make_intrinsics():
    mma_tf32_1688 = mma_sync_f32_intrinsic("m16n8k8.row.col.f32.tf32.tf32.f32")

    split_tf32 = pair_asm_intrinsic("{ .reg .f32 x, h; and.b32 $0, $2, -8192; mov.b32 x, $2; mov.b32 h, $0; "
                                    "sub.f32 x, x, h; mov.b32 $1, x; }", types.uint32)
    return mma_tf32_1688, split_tf32


# ---------------------------------------------------------------- simulator: Python twins -------------

def _tf32_truncate(x) -> np.uint32:
    """The float32 x with its low 13 bits cleared, as bits."""
    return np.uint32(int(np.array([x], np.float32).view(np.uint32)[0]) & 0xFFFFE000)


def _as_tf32(words) -> np.ndarray:
    """uint32 bit patterns -> float64 values as the tensor cores read them (low 13 bits ignored)."""
    w = np.asarray([int(x) & 0xFFFFE000 for x in words], np.uint32)
    return w.view(np.float32).astype(np.float64)


def _make_fallbacks():
    mma_tf32_1688 = mma_sync_f32_twin(_as_tf32, 1)

    @cuda.jit(device=True)
    def split_tf32(x):
        hi = _tf32_truncate(x)
        lo = np.float32(x) - np.array([hi], np.uint32).view(np.float32)[0]
        return hi, np.array([lo], np.float32).view(np.uint32)[0]

    return mma_tf32_1688, split_tf32


mma_tf32_1688, split_tf32 = _make_fallbacks() if SIMULATOR else _make_intrinsics()


def make_mma3_tiles(n_tiles: int):
    """Device function ``mma3_tiles(acc, acc0, first, end, ah0..ah3, al0..al3, bfr)``: for n8 tiles
    first <= nt < end (of ``n_tiles``, a compile-time constant), acc[acc0 + 4nt : +4] += A·B_nt with
    A = ah + al and B_nt = bfr[4nt : 4nt+4] = (hi0, hi1, lo0, lo1). The three terms go in three passes over
    the tiles, so consecutive mma are independent (one accumulator per tile, no chain of three back to back)."""

    @cuda.jit(device=True, inline=True)
    def mma3_tiles(acc, acc0, first, end, ah0, ah1, ah2, ah3, al0, al1, al2, al3, bfr):
        for nt in range(n_tiles):
            if first <= nt < end:
                x = acc0 + 4 * nt
                acc[x], acc[x + 1], acc[x + 2], acc[x + 3] = mma_tf32_1688(
                    al0, al1, al2, al3, bfr[4 * nt], bfr[4 * nt + 1], acc[x], acc[x + 1], acc[x + 2], acc[x + 3])
        for nt in range(n_tiles):
            if first <= nt < end:
                x = acc0 + 4 * nt
                acc[x], acc[x + 1], acc[x + 2], acc[x + 3] = mma_tf32_1688(
                    ah0, ah1, ah2, ah3, bfr[4 * nt + 2], bfr[4 * nt + 3], acc[x], acc[x + 1], acc[x + 2],
                    acc[x + 3])
        for nt in range(n_tiles):
            if first <= nt < end:
                x = acc0 + 4 * nt
                acc[x], acc[x + 1], acc[x + 2], acc[x + 3] = mma_tf32_1688(
                    ah0, ah1, ah2, ah3, bfr[4 * nt], bfr[4 * nt + 1], acc[x], acc[x + 1], acc[x + 2], acc[x + 3])

    return mma3_tiles


def make_a_split_ldmatrix(stride: int):
    """Device function ``load(smem_u, base) -> (hi0..hi3, lo0..lo3)``: the split A fragment of the 16x8 float32
    tile whose element [0, 0] is word ``base`` of a row-major shared tile with row stride ``stride`` (a
    multiple of 4, rows 16-byte aligned), by one ``ldmatrix.x4`` (each 8x8 b16 matrix is an 8x4 float32
    block: lanes 0-7 address rows 0-7, 8-15 rows 8-15, 16-31 the same rows 4 columns on) instead of four
    loads with their address arithmetic. Every lane of the warp must call it."""

    @cuda.jit(device=True, inline=True)
    def load_a_ldmatrix(smem_u, base):
        lane = cuda.threadIdx.x & 31
        row = (lane & 7) + 8 * ((lane >> 3) & 1)
        r0, r1, r2, r3 = ldmatrix_x4(smem_u, uint32(base + row * stride + 4 * (lane >> 4)))
        h0, l0 = split_tf32(i32_as_f32(r0))
        h1, l1 = split_tf32(i32_as_f32(r1))
        h2, l2 = split_tf32(i32_as_f32(r2))
        h3, l3 = split_tf32(i32_as_f32(r3))
        return h0, h1, h2, h3, l0, l1, l2, l3

    return load_a_ldmatrix
