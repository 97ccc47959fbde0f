"""Reductions inside a warp or a block, shared by the kernel families.

Every kernel that sums a row the same way gets the same float32 result bit for bit (the fixed tree order
is part of the contract: the references emulate it where they must).
"""
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.ptx import shfl_xor_f32


@cuda.jit(device=True)
def row_sum_f32(v, width):
    """Sum of v over each aligned group of ``width`` lanes (a power of two <= 32), returned to every lane
    of the group (butterfly shuffles). Every lane of the warp must call it."""
    for m in (16, 8, 4, 2, 1):
        if m < width:
            v += shfl_xor_f32(v, m)
    return v


@cuda.jit(device=True)
def row_max_f32(v, width):
    """Maximum of v over each aligned group of ``width`` lanes, as row_sum_f32 sums (same contract)."""
    for m in (16, 8, 4, 2, 1):
        if m < width:
            v = max(v, shfl_xor_f32(v, m))
    return v


@cuda.jit(device=True)
def block_sum_pow2(s_buf, tid, n):
    """Tree sum of s_buf[0:n] in shared memory (n a power of two, every thread of the block calls it).

    Returns the total to every thread; s_buf is clobbered. The trailing barrier lets the caller reuse
    s_buf right after.
    """
    stride = n // 2
    while stride > 0:
        if tid < stride:
            s_buf[tid] += s_buf[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = s_buf[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def block_sum2_pow2(s_a, s_b, tid, n):
    """Two tree sums at once (same contract as block_sum_pow2), one barrier per level."""
    stride = n // 2
    while stride > 0:
        if tid < stride:
            s_a[tid] += s_a[tid + stride]
            s_b[tid] += s_b[tid + stride]
        cuda.syncthreads()
        stride //= 2
    ta = s_a[0]
    tb = s_b[0]
    cuda.syncthreads()
    return ta, tb


@cuda.jit(device=True)
def block_publish2(a, b, s_a, s_b):
    """Thread tid's pair into s_a[tid], s_b[tid] between two barriers (the first: earlier readers of the
    arrays are done), visible to the whole block on return; returns tid. The start of a block-wide reduction
    or scan over two values."""
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    s_a[tid] = a
    s_b[tid] = b
    cuda.syncthreads()
    return tid
