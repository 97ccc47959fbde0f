"""Snapshots of a sequence's device state (engine/cache.py's SequenceState) for the prefix cache
(engine/prefix_cache.py): taken by the CUDA runner and the batched decoder's slots, restored into either.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ninfer_numba.engine.cache import SequenceState
from ninfer_numba.kernels import position
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda


class CudaSnapshot:
    """The state after ``pos`` tokens, in one device buffer of bytes: each attention layer's cached rows < pos
    of every KV head (f16 rows, or a coded cache's codes and norms) and every GDN layer's conv and recurrent
    state. One driver copy per piece: DeviceNDArray.copy_to_device and the per-head views cost ~0.2 ms of
    Python each, 27 ms per snapshot of the 9B (H200, 128 tokens)."""

    def __init__(self, st: SequenceState, stream) -> None:
        self.pos = st.host_pos
        pieces = _pieces(st, self.pos)
        self.sizes = [n for _, _, n in pieces]             # checked on restore: the same model's layout
        self.nbytes = sum(self.sizes)
        self.buf = cuda.device_array(max(self.nbytes, 1), np.uint8, stream=stream)   # [nbytes] uint8
        at = 0
        for a, off, n in pieces:
            _copy_bytes(self.buf, at, a, off, n, stream)
            at += n

    def restore_into(self, st: SequenceState, stream) -> None:
        pieces = _pieces(st, self.pos)
        if [n for _, _, n in pieces] != self.sizes:
            raise ValueError("snapshot of another model's state layout")
        at = 0
        for a, off, n in pieces:
            _copy_bytes(a, off, self.buf, at, n, stream)
            at += n
        position.set_position(st.pos, self.pos, stream=stream)
        st.host_pos = self.pos


def _pieces(st: SequenceState, p: int) -> list[tuple]:
    """(array, byte offset, bytes) of what a state holds after p tokens, in a fixed order: per attention layer
    the rows < p of each KV head of its caches ([Hkv, max_seq, ...] with each head's rows contiguous; a coded
    cache's codes and norms), then each GDN state whole."""
    out = []
    for i in st.attention_layers:
        for a in st.kvq.get(i) or (st.k_cache[i], st.v_cache[i]):
            out += [(a, h * a.strides[0], p * a.strides[1]) for h in range(a.shape[0]) if p]
    for states in (st.conv, st.ssm):
        out += [(states[i], 0, states[i].nbytes) for i in sorted(states)]
    return out


def copy_rows(dst: SequenceState, src: SequenceState, rows: int, stream) -> None:
    """The rows < rows of every cache and every GDN state of src into dst, positions untouched (a slot of the
    batched decoder and its staging state: engine/batched.py): one driver copy per piece, all on stream, so
    a CUDA graph can capture them."""
    to, of = _pieces(dst, rows), _pieces(src, rows)
    if [n for *_, n in to] != [n for *_, n in of]:
        raise ValueError("states of different layouts")
    for (d, d_off, n), (s, s_off, _) in zip(to, of):
        _copy_bytes(d, d_off, s, s_off, n, stream)


class _DevicePointer:
    """A device address as numba's driver copies take it."""
    __cuda_memory__ = True

    def __init__(self, address: int) -> None:
        self.device_ctypes_pointer = ctypes.c_void_p(address)


def _copy_bytes(dst, dst_off: int, src, src_off: int, n: int, stream) -> None:
    """n bytes from src's byte src_off to dst's byte dst_off (both contiguous device arrays), on stream."""
    if SIMULATOR:          # no driver: byte views of the simulated arrays
        flat = lambda a: a.reshape(a.size).view(np.uint8)    # noqa: E731
        flat(dst)[dst_off:dst_off + n].copy_to_device(flat(src)[src_off:src_off + n], stream=stream)
        return
    from numba.cuda.cudadrv.driver import device_to_device
    device_to_device(_DevicePointer(dst.device_ctypes_pointer.value + dst_off),
                     _DevicePointer(src.device_ctypes_pointer.value + src_off), n, stream)
