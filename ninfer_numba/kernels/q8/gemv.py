"""Decode GEMV on Q8 weights with dp4a: out[n] (+)= sum_b ws[n, b] * xs[0, b] * S[n, b].

Layouts (q8/ref.py): wq int8 [N, K] row-major, ws float16 [N, K/32], xq int8 [1, K], xs float32 [1, K/32];
out float32 [N] (a [1, N] row is accepted by the launcher and viewed as [N]).

Decode streams every weight byte once per token, so this kernel is a memory copy with arithmetic on the
side. One warp owns one row. Per step each lane issues ``loads`` independent 16-byte non-coherent loads
(``ld.global.nc.v4``) of the row, lane-interleaved so a warp's load instruction covers 512 contiguous
bytes (fully coalesced), with the activation's matching words, and only then consumes them (loading the
activation's words in the consume loop instead let ptxas interleave the weight loads with the dot
products: checked in the sm_90 SASS). ``loads`` is chosen per K (loads_per_step) so that the steps of
a row are as full as they can be: with a fixed 8 loads (4 KiB per step) a 27B row of 5120 bytes took a
full step and a quarter step, 17408 bytes four and a quarter, and the 27B GEMVs ran at 82.6 % of copy
bandwidth against 94.4 % on the 9B's 4096- and 12288-byte rows. At most MAX_LOADS, so the step's words
and scales fit the 128-register budget without spills.

A 32-byte Q8 block spans two lanes (16 bytes each). Each lane sums its half with 4 dp4a; one xor-1
shuffle adds the partner's half, giving the block's exact int32 dot product S (|S| <= 2^19) on both
lanes; the even lane applies the block scale: term = (float(ws) * xs) * float(S) in float32. Partial fp32
sums are folded with a 5-step butterfly at the end. Error bound vs the exact result: see
q8.ref.q8_error_bound ((K/32 + 4) u of the absolute term sum).

Tails: K % 32 == 0 guarantees both lanes of a block pair are in or out of range together. Out-of-range
loads are redirected to offset 0 of the row (a valid address) and their contribution is zeroed, so the
step is branch-free and every lane reaches every shuffle. Rows past N are clamped to row N-1 and not stored.
"""
from functools import lru_cache

import numpy as np

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.q8.ref import q8_matmul_ref  # noqa: F401  (reference of this family)

WARPS = 4                    # rows per thread block (one warp each)
MAX_LOADS = 10               # 16-byte weight loads in flight per lane per step, at most
_F0 = np.float32(0.0)
# A register budget of 128 (4 blocks of 128 threads per SM): without it ptxas squeezes the kernel into
# 32 registers by interleaving each load with its use, leaving ~2 loads in flight per lane instead of all
# 2 * LOADS (checked in the sm_90a SASS). The simulator's jit takes no launch_bounds.
_OCCUPANCY = {} if SIMULATOR else {"launch_bounds": (32 * WARPS, 4)}


@cuda.jit(device=True, inline=True)
def _dot16(w, x):
    """Exact int32 dot product of 16 int8 pairs packed in two 4-tuples of uint32 words."""
    s = ptx.dp4a(w[0], x[0], 0)
    s = ptx.dp4a(w[1], x[1], s)
    s = ptx.dp4a(w[2], x[2], s)
    return ptx.dp4a(w[3], x[3], s)


def loads_per_step(k: int) -> int:
    """Weight loads per lane per step for rows of k bytes: the fewest steps of at most MAX_LOADS, then the
    fewest loads that cover the row in that many steps (4096 -> 8, 5120 -> 10, 12288 -> 8, 17408 -> 9)."""
    per_lane = -(-k // 512)
    steps = -(-per_lane // MAX_LOADS)
    return -(-per_lane // steps)


@lru_cache(maxsize=None)
def _gemv_q8_kernel(loads: int):
    step = loads * 512               # bytes of a row consumed per warp per step

    @cached_jit(pdl=True, **_OCCUPANCY)
    def gemv(wq, ws, xq, xs, out, accumulate):
        """wq: [N, K] int8, ws: [N, K/32] f16, xq: [1, K] int8, xs: [1, K/32] f32, out: [N] f32.
        grid (ceil(N / WARPS),), block (32 * WARPS,)."""
        griddep_wait()                                # kernels/pdl.py: before any global access
        griddep_launch_dependents()
        n_rows = wq.shape[0]
        k = wq.shape[1]
        lane = cuda.threadIdx.x & 31
        n = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
        row = min(n, n_rows - 1)                          # warps past N work on a valid row, store nothing
        row_base = row * k                                # flat index of wq[row, 0]
        is_even = (lane & 1) == 0
        acc = _F0
        for k0 in range(0, k, step):
            # lane-interleaved offsets: load j of lane l reads row bytes k0 + 512 j + 16 l
            w_words = cuda.local.array((loads, 4), dtype=np.uint32)   # [loads, 4] weight words (registers)
            x_words = cuda.local.array((loads, 4), dtype=np.uint32)   # [loads, 4] activation words
            w_scale = cuda.local.array(loads, dtype=np.float32)       # [loads] ws of each load's block
            x_scale = cuda.local.array(loads, dtype=np.float32)       # [loads] xs of each load's block
            for j in range(loads):     # branch-free, so every load of the step is issued before any use
                off = k0 + j * 512 + lane * 16
                off = off if off < k else 0
                wv = ptx.ldg_nc_v4_u32(wq, row_base + off)
                xv = ptx.ldg_nc_v4_u32(xq, off)
                for e in range(4):
                    w_words[j, e] = wv[e]
                    x_words[j, e] = xv[e]
                w_scale[j] = np.float32(ws[row, off >> 5])         # off >> 5 == off // 32, off >= 0
                x_scale[j] = xs[0, off >> 5]
            for j in range(loads):
                half = _dot16(w_words[j], x_words[j])
                block_sum = np.int32(half + ptx.shfl_xor_i32(half, 1))  # exact int32 S of the 32-block
                if k0 + j * 512 + lane * 16 < k and is_even:
                    acc += (w_scale[j] * x_scale[j]) * np.float32(block_sum)
        for mask in (16, 8, 4, 2, 1):
            acc += ptx.shfl_xor_f32(acc, mask)
        if lane == 0 and n < n_rows:
            out[n] = acc + out[n] if accumulate else acc

    return gemv


def gemv_q8(wq, ws, xq, xs, out, *, accumulate=False, stream=0):
    """out = W x (or out += W x). wq: [N, K] int8, ws: [N, K/32] float16, xq: [1, K] int8,
    xs: [1, K/32] float32, out: [N] float32 (or [1, N], viewed as [N] at a little host cost).
    K % 32 == 0; wq and xq must start 16-byte aligned (device allocations are 256-byte aligned)."""
    n_rows = wq.shape[0]
    if out.ndim == 2:
        out = out.reshape(n_rows)
    kernel = _gemv_q8_kernel(loads_per_step(wq.shape[1]))
    kernel[(n_rows + WARPS - 1) // WARPS, 32 * WARPS, stream](wq, ws, xq, xs, out, 1 if accumulate else 0)
