"""Float16 activations for the W8A16 prefill GEMM (gemm_w8a16.py takes ``xh: float16 [M, K]`` in fragment
order): plain conversion, fused with RMSNorm, fused with SiLU gating, fused with the GDN output's gated
RMSNorm. The float16 counterparts of quant_act.py.

Layout: inputs float32 [M, K] (SiLU: [M, 2F], gate columns [0, F), up columns [F, 2F)), C-contiguous with
16-byte aligned rows (K % 32 == 0 and an aligned base); outputs float16 [M, K], C-contiguous, in fragment
order (q8.ref.to_fragment_order: the columns of each 32-block permuted for the GEMM's register operand).
The launchers hand the kernels the output as flat uint32 words [M·K/2]. The unit of work is a chunk of 4
consecutive input elements: one 16-byte non-coherent load (ptx.ldg_nc_v4_u32), two ``pack_f16x2``
(cvt.rn.f16x2.f32) and two 4-byte stores, since fragment order keeps pairs of columns together: chunk c of a
32-block (columns 4c..4c+3) lands at positions l0 = 16 (c & 1) + 2 (c >> 1) and l0 + 8. Consecutive threads
take consecutive chunks, so a warp reads 512 and writes 256 contiguous bytes.

Grids (block (TPB,) = 128 threads everywhere; M == 0 launches nothing):
- to_f16: one-dimensional grid-stride loop over the M·K/4 chunks of the flat array (blocks never straddle
  rows, so fragment order is the same on the flat array),
  min(ceil(M·K/4 / TPB), MAX_BLOCKS) blocks.
- rmsnorm_f16, silu_mul_f16: grid (M, Y); the Y blocks of row m take the row's chunks
  blockIdx.y·TPB + tid, then + Y·TPB, ... Y = min(ceil(K/4 / TPB), ceil(SPREAD_BLOCKS / M)): a decode row
  (M = 1) is spread over up to ceil(K/4/TPB) blocks, a large prefill (M >= SPREAD_BLOCKS) gets one block per
  row. RMSNorm needs the whole row's sum of squares, so each of a row's Y blocks computes it (the row is at
  most 70 KB and sits in L2) before converting its own chunks.

Numerics: every value is computed in float32 exactly as quant_act computes it, then rounded once to float16,
to nearest even (cvt.rn: overflow gives +-inf, tiny values become subnormal or +-0; NumPy's
``astype(np.float16)`` rounds the same way). RMSNorm takes r = 1 / sqrt(ss / K + eps) from quant_act's
``_row_rms_inverse`` (its fixed sum order over TPB threads), then y = (x · r) · w; SiLU is
quant_act's ``_silu_mul``, g / (1 + exp(-g)) · u. No multiply feeds an add outside the sum of squares and
every constant is a float32 global, so nothing is contracted or promoted to float64: the float32 value
before rounding is the one the int8 path quantizes. to_f16 is therefore bit-exact with NumPy; the fused
kernels differ from NumPy's float32 only in the RMSNorm summation order and the GPU expf, so a result may
be the other float16 neighbour of the reference (tests/kernels/test_act_f16.py states the rule).
"""
import numpy as np

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.flash_attn.mma_f16 import pack_f16x2
from ninfer_numba.kernels.gdn.device_math import gated_rms_apply, gated_rms_inverse
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.q8.quant_act import TPB, WARPS, _row_rms_inverse, _silu_mul
from ninfer_numba.kernels.q8.ref import QK, rmsnorm_f16_ref, silu_mul_f16_ref  # noqa: F401
from ninfer_numba.kernels.reduce import row_sum_f32

VEC = 4                         # elements per chunk: one 16-byte load, two 4-byte stores
MAX_BLOCKS = 4096               # to_f16's grid cap (~31 blocks of TPB per H200 SM; the loop covers the rest)
SPREAD_BLOCKS = 1024            # rows x slices the fused kernels aim for when M is small


# ---------------------------------------------------------------- device helpers ----------------------

@cuda.jit(device=True, inline=True)
def _store_f16x4(out32, base, j, a, b, c, d):
    """Chunk j (input columns 4j..4j+3) rounded to float16 (nearest even) into the uint32 words
    out32[base + ...] in fragment order: (a, b) at position l0 = 16 (j & 1) + 2 ((j >> 1) & 3) of its
    32-block, (c, d) at l0 + 8."""
    word = base + 16 * (j >> 3) + 8 * (j & 1) + ((j >> 1) & 3)
    out32[word] = pack_f16x2(a, b)
    out32[word + 4] = pack_f16x2(c, d)


@cuda.jit(device=True, inline=True)
def _load4(src, flat):
    """The 4 float32 at flat element index ``flat`` of src (16-byte aligned)."""
    w = ptx.ldg_nc_v4_u32(src, flat)
    return ptx.i32_as_f32(w[0]), ptx.i32_as_f32(w[1]), ptx.i32_as_f32(w[2]), ptx.i32_as_f32(w[3])


# ---------------------------------------------------------------- kernels -----------------------------

@cached_jit()
def _to_f16_kernel(x, out):
    """x: [M·K] f32 (flat) -> out: [M·K/2] uint32 (flat, 2 f16 each, fragment order); 1-D grid-stride,
    block (TPB,)."""
    stride = cuda.gridDim.x * TPB
    for c in range(cuda.blockIdx.x * TPB + cuda.threadIdx.x, x.shape[0] // VEC, stride):
        a, b, e, d = _load4(x, VEC * c)
        _store_f16x4(out, 0, c, a, b, e, d)


@cached_jit()
def _rmsnorm_f16_kernel(x, w, eps, out):
    """y = x / sqrt(mean(x^2) + eps) * w in float16. x: [M, K] f32, w: [K] f32 -> out: [M·K/2] uint32
    (fragment order); grid (M, Y), block (TPB,)."""
    s_red = cuda.shared.array(WARPS, dtype=np.float32)       # [WARPS] the warps' sums of squares
    m = cuda.blockIdx.x
    k = x.shape[1]
    r = _row_rms_inverse(s_red, x, m, eps)               # quant_act's: the same float32 value
    for j in range(cuda.blockIdx.y * TPB + cuda.threadIdx.x, k // VEC, TPB * cuda.gridDim.y):
        x0, x1, x2, x3 = _load4(x, m * k + VEC * j)
        w0, w1, w2, w3 = _load4(w, VEC * j)
        _store_f16x4(out, m * (k // 2), j, (x0 * r) * w0, (x1 * r) * w1, (x2 * r) * w2, (x3 * r) * w3)


@cached_jit()
def _silu_mul_f16_kernel(gu, out):
    """silu(gu[:, :F]) * gu[:, F:] in float16. gu: [M, 2F] f32 -> out: [M·F/2] uint32 (fragment order);
    grid (M, Y), block (TPB,)."""
    m = cuda.blockIdx.x
    f = gu.shape[1] // 2
    for j in range(cuda.blockIdx.y * TPB + cuda.threadIdx.x, f // VEC, TPB * cuda.gridDim.y):
        g0, g1, g2, g3 = _load4(gu, m * 2 * f + VEC * j)
        u0, u1, u2, u3 = _load4(gu, m * 2 * f + f + VEC * j)
        _store_f16x4(out, m * (f // 2), j, _silu_mul(g0, u0), _silu_mul(g1, u1), _silu_mul(g2, u2),
                     _silu_mul(g3, u3))


@cached_jit()
def _gated_rmsnorm_f16_kernel(y, proj, z0, norm_w, eps, out):
    """RMSNorm(y per head of S) * norm_w * silu(z) in float16. y: [M, Hv*S] f32 raw GDN output, proj: [M, P]
    f32 (z of element e at column z0 + e), norm_w: [S] f32 -> out: [M·Hv·S/2] uint32 (fragment order);
    grid (M, Y), block (TPB,). A head's S/4 chunks are consecutive lanes of one warp (S/4 a power of two
    <= 32), so its sum of squares is a butterfly over them; the loop runs whole warps (shuffles need them)."""
    m = cuda.blockIdx.x
    n4 = y.shape[1] // VEC
    n4_warps = (n4 + 31) // 32 * 32                      # a lane's j and its warp's first j agree on the bound
    S = norm_w.shape[0]
    lanes = S // VEC                                      # lanes per head
    for j0 in range(cuda.blockIdx.y * TPB + cuda.threadIdx.x, n4_warps, TPB * cuda.gridDim.y):
        j = min(j0, n4 - 1)                               # past the end (whole heads): loaded, not stored
        y0, y1, y2, y3 = _load4(y, m * y.shape[1] + VEC * j)
        ss = row_sum_f32(y0 * y0 + y1 * y1 + y2 * y2 + y3 * y3, lanes)
        if j0 < n4:
            inv_rms = gated_rms_inverse(ss, S, eps)
            e = VEC * j
            d = e % S
            z = z0 + e
            _store_f16x4(out, m * (n4 * 2), j,
                         gated_rms_apply(y0, inv_rms, norm_w[d], proj[m, z]),
                         gated_rms_apply(y1, inv_rms, norm_w[d + 1], proj[m, z + 1]),
                         gated_rms_apply(y2, inv_rms, norm_w[d + 2], proj[m, z + 2]),
                         gated_rms_apply(y3, inv_rms, norm_w[d + 3], proj[m, z + 3]))


# ---------------------------------------------------------------- launchers ---------------------------

def _check(name, m, k, out, k_out):
    if k % QK or tuple(out.shape) != (m, k_out) or out.dtype != np.float16:
        raise ValueError(f"{name}: input [{m}, {k}] (K % {QK} == 0) needs out float16 [{m}, {k_out}], "
                         f"got {out.dtype} {tuple(out.shape)}")


def _row_grid(m, k):
    """(M, Y) for the fused kernels: Y slices of a row of k outputs (module docstring)."""
    per_row = -(-(k // VEC) // TPB)
    return m, max(1, min(per_row, -(-SPREAD_BLOCKS // m)))


def to_f16(x, out, *, stream=0):
    """Round to float16. x: [M, K] float32; out: [M, K] float16 in fragment order (out)."""
    m, k = x.shape
    _check("to_f16", m, k, out, k)
    n = m * k // VEC
    if n:
        grid = min(-(-n // TPB), MAX_BLOCKS)
        _to_f16_kernel[grid, TPB, stream](x.reshape(-1), out.reshape(-1).view(np.uint32))


def rmsnorm_f16(x, w, eps, out, *, stream=0):
    """Fused RMSNorm + float16. x: [M, K] float32; w: [K] float32 (the +1 already folded in); eps: float;
    out: [M, K] float16 in fragment order (out)."""
    m, k = x.shape
    _check("rmsnorm_f16", m, k, out, k)
    if m:
        _rmsnorm_f16_kernel[_row_grid(m, k), TPB, stream](x, w, np.float32(eps), out.reshape(-1).view(np.uint32))


def silu_mul_f16(gu, out, *, stream=0):
    """Fused SiLU gating + float16. gu: [M, 2F] float32 (gate columns [0, F), up columns [F, 2F));
    out: [M, F] float16 in fragment order (out)."""
    m, f2 = gu.shape
    f = f2 // 2
    _check("silu_mul_f16", m, f if 2 * f == f2 else 1, out, f)
    if m:
        _silu_mul_f16_kernel[_row_grid(m, f), TPB, stream](gu, out.reshape(-1).view(np.uint32))


def gated_rmsnorm_f16(y, proj, z0: int, norm_w, eps, out, *, stream=0):
    """Fused GDN gated RMSNorm + float16. y: [M, Hv*S] float32 raw o (gdn_prefill, normalize=False);
    proj: [M, P] float32 with z at columns [z0, z0 + Hv*S); norm_w: [S] float32 (S/4 a power of two <= 32);
    eps: float; out: [M, Hv*S] float16 in fragment order (out)."""
    m, k = y.shape
    S = norm_w.shape[0]
    lanes = S // VEC
    if S % VEC or lanes > 32 or lanes & (lanes - 1):
        raise ValueError(f"gated_rmsnorm_f16: head size {S} must be 4 times a power of two <= 32")
    _check("gated_rmsnorm_f16", m, k, out, k)
    if m:
        _gated_rmsnorm_f16_kernel[_row_grid(m, k), TPB, stream](y, proj, np.int32(z0), norm_w, np.float32(eps),
                                                                out.reshape(-1).view(np.uint32))
