"""Weight types: NumPy dequantization and the Q8_0 split used by the kernels.

Q8_0 (ggml): blocks of 32 weights stored as a float16 scale d followed by 32 int8 quants q; w = d·q.
The kernels want the quants and scales apart (``split_q8_0``): an int8 matrix whose rows are 16-byte
aligned and a float16 scale matrix, the same 34 bytes per 32 weights as the file.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from ninfer_numba.config import ModelFormatError

SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0)
Q8_BLOCK = 32
Q8_BLOCK_BYTES = 34
_Q8_DTYPE = np.dtype([("d", "<f2"), ("q", "i1", (Q8_BLOCK,))])


def check_supported(name: str, qtype: QT) -> None:
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ModelFormatError(f"tensor {name} has type {qtype.name}; supported weight types are {names}")


def split_q8_0(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 bytes of a [rows, K] tensor -> (q: int8 [rows, K], d: float16 [rows, K/32]) (copies)."""
    rows, k = (1, shape[0]) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])
    blocks = np.frombuffer(raw, dtype=_Q8_DTYPE).reshape(rows, k // Q8_BLOCK)
    return np.ascontiguousarray(blocks["q"]).reshape(rows, k), np.ascontiguousarray(blocks["d"])


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [rows, K] -> (q int8 [rows, K], d float16 [rows, K/32]) with ggml's Q8_0 rounding.

    ggml: d = amax/127, q = round(x / d) (round half away from zero), d stored as float16.
    """
    rows, k = w.shape
    blocks = w.astype(np.float32).reshape(rows, k // Q8_BLOCK, Q8_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(d[..., None] > 0, blocks / d[..., None], 0.0)
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)
    return q.reshape(rows, k), d.astype(np.float16)


def pack_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(q int8 [rows, K], d float16 [rows, K/32]) -> raw Q8_0 bytes uint8 [rows, K/32·34] (GGUF layout)."""
    rows, k = q.shape
    blocks = np.empty((rows, k // Q8_BLOCK), dtype=_Q8_DTYPE)
    blocks["d"] = d
    blocks["q"] = q.reshape(rows, k // Q8_BLOCK, Q8_BLOCK)
    return blocks.view(np.uint8).reshape(rows, -1)


def dequantize(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes -> float32 array of ``shape`` (NumPy order)."""
    if qtype == QT.F32:
        return np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32, copy=True)
    if qtype == QT.F16:
        return np.frombuffer(raw, dtype="<f2").reshape(shape).astype(np.float32)
    if qtype == QT.BF16:
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if qtype == QT.Q8_0:
        blocks = np.frombuffer(raw, dtype=_Q8_DTYPE)
        out = blocks["q"].astype(np.float32) * blocks["d"].astype(np.float32)[:, None]
        return out.reshape(shape)
    raise ModelFormatError(f"cannot dequantize type {qtype.name}")


def row_slice_bytes(raw: np.ndarray, qtype: QT, row_len: int, start: int, stop: int) -> np.ndarray:
    """Raw bytes of rows [start, stop) of a 2-D tensor with ``row_len`` elements per row (a view)."""
    from gguf import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[qtype]
    row_bytes = row_len // block * size
    return raw[start * row_bytes: stop * row_bytes]
