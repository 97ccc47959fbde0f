"""Log-probabilities on the device: the chosen token's log-softmax and the n most likely tokens, for requests
that ask for logprobs (engine/sampling.py's ``token_logprob`` is the host reference, same ordering).

One launch, graph-capturable, no allocation. Every thread runs an online log-sum-exp over its grid-stride
share of the logits (float32 values, float64 sums) and each block combines its threads'; the block's n best
(value descending, index ascending) are found by n rounds of block argmax over the block's share, each round
skipping the indices already taken; the block that finishes last (a ticket, as in device.py) merges the
blocks' partials the same way and writes the record. n and the chosen token are read from device memory, so
one captured graph serves every request.

Record rec [REC_LEN] float64: rec[0] = logit[token] - lse, rec[1] = lse, then for r < n: rec[2 + 2r] = id of
the r-th most likely token, rec[3 + 2r] = its log-probability (ids past n are -1).
"""
from __future__ import annotations

import math

import numpy as np

from ninfer_numba.config import MAX_TOP_LOGPROBS
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.reduce import block_publish2
from ninfer_numba.kernels.sample.device import _block_argmax, _better
from ninfer_numba.kernels.sample.radix_select import G_MAX, ITEMS, TPB, _is_last_block

MAX_TOP = MAX_TOP_LOGPROBS
REC_LEN = 2 + 2 * MAX_TOP
_NEG_INF = np.float32(-np.inf)


class LogprobWorkspace:
    """Device scratch and the record for token_logprobs at vocabulary size V; allocate once."""

    def __init__(self, n_vocab: int, stream=0) -> None:
        self.grid = int(min(G_MAX, max(1, -(-n_vocab // (TPB * ITEMS)))))
        zeros = lambda shape, dt: cuda.to_device(np.zeros(shape, dt), stream=stream)  # noqa: E731
        self.part_m = zeros(G_MAX, np.float32)                   # [G] block max of the logits
        self.part_s = zeros(G_MAX, np.float64)                   # [G] block sum of exp(x - part_m)
        self.part_v = zeros(G_MAX * MAX_TOP, np.float32)         # [G, MAX_TOP] block's best values
        self.part_i = zeros(G_MAX * MAX_TOP, np.int64)           # [G, MAX_TOP] their ids (-1: none)
        self.done = zeros(1, np.int32)                           # last-block ticket
        self.n_top = zeros(1, np.int32)                          # [1] alternatives to list (<= MAX_TOP)
        self.rec = zeros(REC_LEN, np.float64)                    # [REC_LEN] the record (module docstring)


@cuda.jit(device=True, inline=True)
def _lse_add(m, s, x, sx):
    """(m, s) + (x, sx): log-sum-exp pairs, value m with sum s of exp(. - m); m = -inf means empty."""
    if x == _NEG_INF:
        return m, s
    if m == _NEG_INF:
        return x, sx
    if x > m:
        return x, s * math.exp(np.float64(m) - np.float64(x)) + sx
    return m, s + sx * math.exp(np.float64(x) - np.float64(m))


@cuda.jit(device=True)
def _block_lse(m, s, s_m, s_s):
    """Every thread's pair combined over the block (returned to every thread)."""
    tid = block_publish2(m, s, s_m, s_s)
    h = TPB // 2
    while h > 0:
        if tid < h:
            s_m[tid], s_s[tid] = _lse_add(s_m[tid], s_s[tid], s_m[tid + h], s_s[tid + h])
        cuda.syncthreads()
        h //= 2
    return s_m[0], s_s[0]


@cuda.jit(device=True, inline=True)
def _taken(s_sel, r, i):
    for q in range(r):
        if s_sel[q] == i:
            return True
    return False


@cached_jit()
def _logprobs_kernel(logits, token, n_top, part_m, part_s, part_v, part_i, done, rec):
    # logits: [V] f32; token: [1] int32 (the chosen id); n_top: [1] int32; part_*: [G_MAX(·MAX_TOP)];
    # done: [1] int32 ticket; rec: [REC_LEN] f64 out
    s_m = cuda.shared.array(TPB, np.float32)
    s_s = cuda.shared.array(TPB, np.float64)
    s_v = cuda.shared.array(TPB, np.float32)
    s_i = cuda.shared.array(TPB, np.int64)
    s_sel = cuda.shared.array(MAX_TOP, np.int64)
    s_flag = cuda.shared.array(1, np.int32)
    tid = cuda.threadIdx.x
    b = cuda.blockIdx.x
    V = logits.shape[0]
    stride = cuda.gridDim.x * TPB
    n = min(max(n_top[0], 0), MAX_TOP)
    m = _NEG_INF
    s = np.float64(0.0)
    i = np.int64(b) * TPB + tid
    while i < V:
        m, s = _lse_add(m, s, logits[i], np.float64(1.0))
        i += stride
    m, s = _block_lse(m, s, s_m, s_s)
    for r in range(n):                         # the block's r-th best, skipping those already taken
        best_v = np.float32(0.0)
        best_i = np.int64(-1)
        i = np.int64(b) * TPB + tid
        while i < V:
            if _better(best_v, best_i, logits[i], i) and not _taken(s_sel, r, i):
                best_v = logits[i]
                best_i = i
            i += stride
        bv, bi = _block_argmax(best_v, best_i, s_v, s_i)
        if tid == 0:
            s_sel[r] = bi
            part_v[b * MAX_TOP + r] = bv
            part_i[b * MAX_TOP + r] = bi
        cuda.syncthreads()
    if tid == 0:
        part_m[b] = m
        part_s[b] = s
    if not _is_last_block(done, 0, s_flag):
        return
    m = _NEG_INF
    s = np.float64(0.0)
    for j in range(tid, cuda.gridDim.x, TPB):
        m, s = _lse_add(m, s, part_m[j], part_s[j])
    m, s = _block_lse(m, s, s_m, s_s)
    lse = np.float64(m) + math.log(s)
    n_cand = cuda.gridDim.x * MAX_TOP
    for r in range(n):                         # the grid's r-th best among the blocks' candidates
        best_v = np.float32(0.0)
        best_i = np.int64(-1)
        for j in range(tid, n_cand, TPB):
            if j % MAX_TOP < n and _better(best_v, best_i, part_v[j], part_i[j]) and not _taken(s_sel, r, part_i[j]):
                best_v = part_v[j]
                best_i = part_i[j]
        bv, bi = _block_argmax(best_v, best_i, s_v, s_i)
        if tid == 0:
            s_sel[r] = bi
            rec[2 + 2 * r] = np.float64(bi)
            rec[3 + 2 * r] = np.float64(bv) - lse
        cuda.syncthreads()
    if tid == 0:
        for r in range(n, MAX_TOP):
            rec[2 + 2 * r] = -1.0
            rec[3 + 2 * r] = 0.0
        rec[0] = np.float64(logits[token[0]]) - lse
        rec[1] = lse
        done[0] = 0


def token_logprobs(logits, token, ws: LogprobWorkspace, stream=0) -> None:
    """ws.rec <- the record of ``token`` ([1] int32, device) under ``logits`` ([V] float32) with ws.n_top[0]
    alternatives (set it once per request)."""
    _logprobs_kernel[ws.grid, TPB, stream](logits, token, ws.n_top, ws.part_m, ws.part_s, ws.part_v, ws.part_i,
                                           ws.done, ws.rec)


def record_to_host(rec: np.ndarray, token: int, n_top: int):
    """engine.sampling.TokenLogprob from a record copied to the host."""
    from ninfer_numba.engine.sampling import TokenLogprob
    top = tuple((int(rec[2 + 2 * r]), float(rec[3 + 2 * r])) for r in range(n_top))
    return TokenLogprob(int(token), float(rec[0]), top)
