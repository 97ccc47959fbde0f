"""Tiny bookkeeping kernels for graph-replayable steps: positions live on the device, not in arguments.

A CUDA graph bakes kernel arguments in, so the decode step cannot take its position as a Python int. The
sequence keeps ``pos`` (tokens already cached) and ``kv_len`` (cache rows valid during this forward) in
device int32 [1] buffers ([B], one per row, for a batched decode step); these kernels update them inside
the captured step.
"""
import numpy as np

from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.numba_env import cuda

TPB = 256


@cached_jit(pdl=True)
def _set_kv_len(pos, kv_len, t):
    # pos: [B] int32, kv_len: [B] int32 (out), t: tokens of this forward (B rows of a batched decode: B <= 16)
    griddep_wait()                                # kernels/pdl.py: before any global access
    griddep_launch_dependents()
    if cuda.grid(1) == 0:
        for b in range(pos.shape[0]):
            kv_len[b] = pos[b] + t


@cached_jit(pdl=True)
def _advance(pos, t):
    # pos: [B] int32 (in/out)
    griddep_wait()                                # kernels/pdl.py: before any global access
    griddep_launch_dependents()
    if cuda.grid(1) == 0:
        for b in range(pos.shape[0]):
            pos[b] += t


@cached_jit()
def _set(pos, value):
    if cuda.grid(1) == 0:
        pos[0] = value


@cached_jit()
def _fill_zero(a):
    # a: [N] float32, grid-stride
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < a.shape[0]:
        a[i] = 0.0
        i += stride


def set_kv_len(pos, kv_len, t: int, *, stream=0) -> None:
    """kv_len[b] = pos[b] + t for every row b (one sequence: b = 0)."""
    _set_kv_len[1, 1, stream](pos, kv_len, np.int32(t))


def advance(pos, t: int, *, stream=0) -> None:
    """pos[b] += t for every row b."""
    _advance[1, 1, stream](pos, np.int32(t))


def set_position(pos, value: int, *, stream=0) -> None:
    """pos[0] = value."""
    _set[1, 1, stream](pos, np.int32(value))


def fill_zero(a, *, stream=0) -> None:
    """a[:] = 0 for a flat float32 device array."""
    blocks = min(1024, (a.shape[0] + TPB - 1) // TPB)
    _fill_zero[max(blocks, 1), TPB, stream](a)
