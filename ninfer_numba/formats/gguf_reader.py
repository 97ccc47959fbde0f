"""GGUF reader: header, metadata, tensor infos, memory-mapped tensor views.

The type codes, quant block sizes and alignment rules come from the ``gguf`` package; the parse itself is
our own because ``gguf.GGUFReader`` builds a NumPy view per array element and takes ~13 s on a file that
carries the 248,320-token Qwen vocabulary and its merges, where this parser takes well under a second.
Tensor data is never copied: ``GGUFFile.tensor_bytes`` returns a view into one read-only ``np.memmap``.

Every count and size in the header is checked against what the file can hold before anything is allocated
or looped over (a corrupted count of 2^63 entries fails at once instead of running out of memory), the
alignment must be a power of two and every tensor's data must start on it and end inside the file.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ninfer_numba.config import ModelFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                    # GGML_MAX_DIMS
MIN_KV_BYTES = 13               # key length (8) + one key byte + value type (4)
MIN_TENSOR_INFO_BYTES = 33      # name length (8) + one name byte + n_dims (4) + one dim (8) + type (4) + offset (8)

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY_ARRAY_TYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "<?",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]     # NumPy order (rows first): the reverse of GGUF's ne
    offset: int                # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class _Cursor:
    """Sequential little-endian reads over the memory map, with truncation reported as a format error."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelFormatError(f"{self.path}: truncated GGUF header (needs byte {self.pos + n}, "
                                   f"file has {len(self.buf)})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def count(self, what: str, min_bytes: int) -> int:
        """A uint64 count of items of at least min_bytes each, checked against the bytes left."""
        n = self.scalar("<Q")
        if n * min_bytes > self.left:
            raise ModelFormatError(f"{self.path}: corrupted GGUF header: {n} {what} at byte {self.pos} would "
                                   f"need at least {n * min_bytes} bytes, the file has {self.left} left")
        return n

    def string(self) -> str:
        n = self.count("string bytes", 1)
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value_type(self) -> GGUFValueType:
        raw = self.scalar("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelFormatError(f"{self.path}: corrupted GGUF header: unknown value type {raw} at byte "
                                   f"{self.pos - 4}") from None

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype = self.value_type()
            if etype in _NUMPY_ARRAY_TYPES:
                dt = np.dtype(_NUMPY_ARRAY_TYPES[etype])
                count = self.count("array elements", dt.itemsize)
                return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).tolist()
            count = self.count("array elements", 8 if etype == GGUFValueType.STRING else 12)
            return [self.value(etype) for _ in range(count)]
        return self.scalar(_SCALAR_FORMATS[vtype])


class GGUFFile:
    """A GGUF file opened read-only: ``kv`` (metadata dict) and ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        p = Path(self.path)
        if not p.exists():
            raise ModelFormatError(f"model file not found: {self.path}")
        if not p.is_file():
            raise ModelFormatError(f"not a file: {self.path}")
        self.file_size = p.stat().st_size
        if self.file_size < 24:
            raise ModelFormatError(f"{self.path}: {self.file_size} bytes is too small to be a GGUF file")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._mm), self.path)
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise ModelFormatError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ModelFormatError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors = cur.count("tensors", MIN_TENSOR_INFO_BYTES)
        n_kv = cur.count("metadata entries", MIN_KV_BYTES)
        self.kv: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.kv[key] = cur.value(cur.value_type())
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFormatError(f"{self.path}: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
            ne = [cur.scalar("<Q") for _ in range(n_dims)]
            raw_type, rel_offset = cur.scalar("<I"), cur.scalar("<Q")
            infos.append((name, ne, raw_type, rel_offset))
        align = self.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align < 1 or align & (align - 1) or align > 1 << 20:
            raise ModelFormatError(f"{self.path}: general.alignment {align!r} is not a power of two")
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, raw_type, rel_offset in infos:
            if name in self.tensors:
                raise ModelFormatError(f"{self.path}: tensor {name} appears twice")
            if rel_offset % align:
                raise ModelFormatError(f"{self.path}: tensor {name} data offset {rel_offset} is not a multiple "
                                       f"of general.alignment {align}")
            self.tensors[name] = self._tensor_info(name, ne, raw_type, data_start + rel_offset)

    def _tensor_info(self, name: str, ne: list[int], raw_type: int, offset: int) -> TensorInfo:
        try:
            gtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelFormatError(f"{self.path}: tensor {name} has unknown ggml type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[gtype]
        n = math.prod(ne)                             # Python ints: a corrupted dimension cannot overflow
        if ne and ne[0] % block:
            raise ModelFormatError(f"{self.path}: tensor {name} row length {ne[0]} is not a multiple of "
                                   f"the {gtype.name} block size {block}")
        nbytes = n // block * type_size
        if offset + nbytes > self.file_size:
            raise ModelFormatError(f"{self.path}: truncated file: tensor {name} ends at byte "
                                   f"{offset + nbytes} but the file has {self.file_size} bytes")
        return TensorInfo(name, gtype, tuple(reversed(ne)), offset, nbytes)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Raw bytes of a tensor (uint8 view into the memory map, no copy)."""
        info = self.tensors[name]
        return self._mm[info.offset:info.offset + info.nbytes]

    def close(self) -> None:
        """Drop this object's reference to the map; views handed out keep it alive until they go too."""
        self._mm = None
