"""Asynchronous copy of a chunk's rows into shared memory, shared by the tensor-core GDN prefill kernels.

``make_row_stager(tpb, n16, rows)`` returns the device function
``stage(smem, off, stride, src, src_off, src_stride, c, zero_tail)``: row i < c of a [rows, 4·n16] float32
tile, read from flat element ``src_off + i·src_stride`` of ``src``, lands at ``smem[off + i·stride]`` by
16-byte cp.async; rows c..rows-1 are zero-filled with plain stores when ``zero_tail``. No commit.
Thread tid always copies 16-byte column chunk tid % n16 of rows tid // n16 + k·(tpb / n16), so every
offset is a running sum (the index arithmetic of a per-element divide cost as much as the copies).
"""
from numba import float32, uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.numba_env import cuda


def make_row_stager(tpb: int, n16: int, rows: int):
    if tpb % n16 != 0:
        raise ValueError(f"{tpb} threads do not split into rows of {n16} 16-byte chunks")
    rpi = tpb // n16                  # rows per pass
    passes = (rows + rpi - 1) // rpi
    f0 = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def stage(smem, off, stride, src, src_off, src_stride, c, zero_tail):
        tid = cuda.threadIdx.x
        i = tid // n16
        q4 = 4 * (tid - i * n16)
        dst = uint32(off + i * stride + q4)
        s = src_off + i * src_stride + q4
        for _ in range(passes):
            if i < rows:
                if i < c:
                    ptx.cp_async_16(smem, dst, src, s)
                elif zero_tail:
                    for x in range(4):
                        smem[dst + uint32(x)] = f0
            i += rpi
            dst += uint32(rpi * stride)
            s += rpi * src_stride

    return stage
