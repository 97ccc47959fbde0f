"""Embedding gather with Q8_0 dequantisation: out[t] = token_embd row tokens[t], as float32.

The repacked Q8_0 table is int8 quants wq [V, D] plus one float16 scale per 32-block ws [V, D/32]; a value
is wq·ws. int8 × float16 has at most 8 + 11 significant bits, so the float32 product is exact and the kernel
is bit-exact against the NumPy reference. The token ids are read from a device buffer (in decode: the one the
sampler writes), so a decode step needs no host round trip and can be one CUDA graph.
Ids outside [0, V) produce a NaN row: a loud result instead of an out-of-bounds read.
"""
from __future__ import annotations

import numpy as np

from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.numba_env import cuda

QK = 32          # Q8_0 block length
TPB_EMBED = 128  # threads per block; blockIdx.y is the token


def embed_gather_q8_ref(wq: np.ndarray, ws: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """wq: [V, D] int8, ws: [V, D/32] float16, tokens: [T] int -> [T, D] float32 (NaN rows for bad ids)."""
    V, D = wq.shape
    tokens = np.asarray(tokens, np.int64)
    out = np.full((tokens.shape[0], D), np.nan, np.float32)
    ok = (tokens >= 0) & (tokens < V)
    rows = tokens[ok]
    out[ok] = wq[rows].astype(np.float32) * np.repeat(ws[rows].astype(np.float32), QK, axis=1)
    return out


@cached_jit(pdl=True)
def _embed_q8_kernel(wq, ws, tokens, out):
    """wq [V, D] int8, ws [V, D/32] float16, tokens [T] int32, out [T, D] float32; grid (ceil(D/TPB), T)."""
    griddep_wait()                                # kernels/pdl.py: before any global access
    griddep_launch_dependents()
    t = cuda.blockIdx.y
    d = cuda.blockIdx.x * TPB_EMBED + cuda.threadIdx.x
    D = out.shape[1]
    if d >= D:
        return
    tok = tokens[t]
    if tok < 0 or tok >= wq.shape[0]:
        out[t, d] = np.float32(np.nan)
        return
    # consecutive threads read consecutive bytes of one row; the scale is shared by 32 threads (broadcast)
    out[t, d] = np.float32(wq[tok, d]) * np.float32(ws[tok, d // QK])


def embed_gather_q8(wq, ws, tokens, out, stream=0) -> None:
    """wq: [V, D] int8; ws: [V, D/32] float16; tokens: [T] int32 (device); out: [T, D] float32."""
    T, D = out.shape
    if T == 0:
        return
    _embed_q8_kernel[((D + TPB_EMBED - 1) // TPB_EMBED, T), TPB_EMBED, stream](wq, ws, tokens, out)
