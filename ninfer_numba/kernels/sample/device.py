"""Token selection on the device: argmax, and sampling with penalties / temperature / top-k / top-p / min-p.

Semantics are those of sample/ref.py, step for step; the draw u = philox_uniform(seed, step) is computed on
the device from the parameter buffer, whose step advances by one per call, so a replayed CUDA graph draws a
fresh, reproducible u every token. Nothing is sorted: the positions needed in the sampling order are found by
radix select (sample/radix_select.py).

Launch sequence of ``sample`` (one stream, no host synchronisation, graph-capturable, no allocation):
  _transform_kernel   penalties + temperature -> z [V] (-inf where a grammar's mask forbids); block argmax;
                      the last block finishes the argmax (greedy ends here), draws u, zeroes the histograms and the select state.
  _hist1_kernel       level-1 histogram of all tokens, m_min and masses; starts the select state machine.
  _refine_kernel x 8  one histogram level of the current select each; idle launches return at once.
"""
from __future__ import annotations

import secrets

import numpy as np

from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.sample.ref import PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1
from ninfer_numba.kernels.sample.radix_select import (
    D_ARGMAX, D_TRANSFORM, F_U, F_ZMAX, G_MAX, IDX_MASK, ITEMS, N_PARAMS, N_REFINE, N_ST, N_STF, NB, P_FREQ,
    P_MASKED, P_MIN_P, P_PRES, P_REP, P_SEED_HI, P_SEED_LO, P_STEP, P_TEMP, P_TOP_K, P_TOP_P, PH_DONE, PH_HIST1,
    S_PHASE, TPB, _hist1_kernel, _is_last_block, _refine_kernel)

__all__ = ["N_PARAMS", "P_STEP", "SampleWorkspace", "argmax", "pack_sample_params", "sample", "update_counts"]

_U64_MASK32 = np.uint64(0xFFFFFFFF)
_U64_32 = np.uint64(32)
_PM0, _PM1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)     # sample/ref.py's Philox-4x32 constants
_PW0, _PW1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)


def pack_sample_params(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                       repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0,
                       seed: int | None = None, step: int = 0, masked: bool = False) -> np.ndarray:
    """Host side of the parameter buffer: [N_PARAMS] float64. seed None draws a random 64-bit seed."""
    if seed is None:
        seed = secrets.randbits(64)
    f32 = lambda x: float(np.float32(x))  # noqa: E731 (the kernels compute with float32 parameters)
    p = np.zeros(N_PARAMS, np.float64)
    p[[P_TEMP, P_TOP_P, P_MIN_P, P_REP, P_PRES, P_FREQ]] = [f32(temperature), f32(top_p), f32(min_p),
                                                            f32(repetition), f32(presence), f32(frequency)]
    p[P_TOP_K] = int(top_k)
    p[P_SEED_LO], p[P_SEED_HI] = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    p[P_STEP] = int(step)
    p[P_MASKED] = float(bool(masked))
    return p


class SampleWorkspace:
    """Device scratch for argmax and sample at vocabulary size V; allocate once, reuse every step."""

    def __init__(self, n_vocab: int, stream=0) -> None:
        if not 1 <= n_vocab <= IDX_MASK + 1:
            raise ValueError(f"vocabulary size {n_vocab} outside [1, {IDX_MASK + 1}]")
        self.n_vocab = n_vocab
        self.grid = int(min(G_MAX, max(1, -(-n_vocab // (TPB * ITEMS)))))
        zeros = lambda n, dt: cuda.to_device(np.zeros(n, dt), stream=stream)  # noqa: E731
        self.z = zeros(n_vocab, np.float32)               # [V] float32 penalised, scaled logits
        self.zbits = self.z.view(np.uint32)               # [V] uint32 the same memory, for the rank keys
        self.part_val = zeros(G_MAX, np.float32)          # [G_MAX] per-block max
        self.part_idx = zeros(G_MAX, np.int64)            # [G_MAX] its index
        self.hist1_cnt = zeros(NB, np.int32)              # [NB] level-1 histogram of all tokens
        self.hist1_mass = zeros(NB, np.int64)
        self.histl_cnt = zeros(NB, np.int32)              # [NB] histogram of the current deeper level
        self.histl_mass = zeros(NB, np.int64)
        self.done = zeros(4, np.int32)                    # last-block tickets, reset by each last block
        self.st = zeros(N_ST, np.int64)
        self.stf = zeros(N_STF, np.float64)
        self.mask = cuda.to_device(np.full(-(-n_vocab // 32), -1, np.int32), stream=stream)  # [ceil(V/32)] bits


# ---------------------------------------------------------------- device helpers

@cuda.jit(device=True, inline=True)
def _better(va, ia, vb, ib):
    """True when candidate (vb, ib) beats (va, ia): larger value, lower index on ties; index -1 = empty."""
    if ib < 0:
        return False
    if ia < 0 or vb > va:
        return True
    return vb == va and ib < ia


@cuda.jit(device=True)
def _block_argmax(v, i, s_v, s_i):
    tid = cuda.threadIdx.x
    cuda.syncthreads()              # a previous call's result may still be being read from s_v[0]
    s_v[tid] = v
    s_i[tid] = i
    cuda.syncthreads()
    s = TPB // 2
    while s > 0:
        if tid < s and _better(s_v[tid], s_i[tid], s_v[tid + s], s_i[tid + s]):
            s_v[tid] = s_v[tid + s]
            s_i[tid] = s_i[tid + s]
        cuda.syncthreads()
        s //= 2
    return s_v[0], s_i[0]


@cuda.jit(device=True, inline=True)
def _take_max(best_v, best_i, v, i):
    """(best_v, best_i) after candidate (v, i); indices come in increasing order per thread, so '>' keeps
    the lowest index of a tie (best_i < 0: no candidate yet)."""
    if best_i < 0 or v > best_v:
        return v, i
    return best_v, best_i


@cuda.jit(device=True)
def _grid_argmax(best_v, best_i, part_val, part_idx, done, slot):
    """Argmax over the grid of every thread's candidate: each block writes its winner to part_*; the last
    block to finish (counted in done[slot]) reduces them. Returns (is_last_block, value, index); value and
    index are the grid's only in the last block."""
    s_v = cuda.shared.array(TPB, np.float32)
    s_i = cuda.shared.array(TPB, np.int64)
    s_flag = cuda.shared.array(1, np.int32)
    tid = cuda.threadIdx.x
    bv, bi = _block_argmax(best_v, best_i, s_v, s_i)
    if tid == 0:
        part_val[cuda.blockIdx.x] = bv
        part_idx[cuda.blockIdx.x] = bi
    if not _is_last_block(done, slot, s_flag):
        return False, bv, bi
    best_v = np.float32(0.0)
    best_i = np.int64(-1)
    for j in range(tid, cuda.gridDim.x, TPB):
        if _better(best_v, best_i, part_val[j], part_idx[j]):
            best_v = part_val[j]
            best_i = part_idx[j]
    bv, bi = _block_argmax(best_v, best_i, s_v, s_i)
    return True, bv, bi


@cuda.jit(device=True)
def _philox_uniform(seed_lo, seed_hi, step):
    """Philox4x32-10 on counter (step_lo, step_hi, 0, 0), key (seed_lo, seed_hi) -> 53-bit u in [0, 1)."""
    c0 = np.uint64(step) & _U64_MASK32
    c1 = (np.uint64(step) >> _U64_32) & _U64_MASK32
    c2 = np.uint64(0)
    c3 = np.uint64(0)
    k0 = np.uint64(seed_lo)
    k1 = np.uint64(seed_hi)
    for r in range(10):
        if r > 0:
            k0 = (k0 + _PW0) & _U64_MASK32
            k1 = (k1 + _PW1) & _U64_MASK32
        p0 = _PM0 * c0
        p1 = _PM1 * c2
        n0 = (p1 >> _U64_32) ^ c1 ^ k0
        n2 = (p0 >> _U64_32) ^ c3 ^ k1
        c1 = p1 & _U64_MASK32
        c3 = p0 & _U64_MASK32
        c0 = n0
        c2 = n2
    hi = np.float64(c0 >> np.uint64(5))
    lo = np.float64(c1 >> np.uint64(6))
    return (hi * 67108864.0 + lo) / 9007199254740992.0


# ---------------------------------------------------------------- kernels

@cached_jit(pdl=True)
def _argmax_kernel(logits, part_val, part_idx, done, out_token):
    """logits [V] float32 -> out_token [1] int32: first index of the maximum."""
    griddep_wait()                                # kernels/pdl.py: before any global access
    griddep_launch_dependents()
    tid = cuda.threadIdx.x
    V = logits.shape[0]
    best_v = np.float32(0.0)
    best_i = np.int64(-1)
    i = np.int64(cuda.blockIdx.x) * TPB + tid
    while i < V:                        # grid-stride
        best_v, best_i = _take_max(best_v, best_i, logits[i], i)
        i += cuda.gridDim.x * TPB
    last, bv, bi = _grid_argmax(best_v, best_i, part_val, part_idx, done, D_ARGMAX)
    if not last:
        return
    if tid == 0:
        out_token[0] = np.int32(bi)
        done[D_ARGMAX] = 0


@cached_jit()
def _transform_kernel(logits, counts, params, mask, z, part_val, part_idx, done, st, stf,
                      hist1_cnt, hist1_mass, histl_cnt, histl_mass, out_token):
    """z = penalised logits / temperature, -inf where params[P_MASKED] and the token's bit in mask [ceil(V/32)]
    int32 is clear; argmax of z (greedy ends here); draw u; reset the select state."""
    tid = cuda.threadIdx.x
    V = z.shape[0]
    temp = params[P_TEMP]
    t32 = np.float32(temp)
    rep32 = np.float32(params[P_REP])
    pres = params[P_PRES]
    freq = params[P_FREQ]
    masked = params[P_MASKED] != 0.0
    best_v = np.float32(0.0)
    best_i = np.int64(-1)
    i = np.int64(cuda.blockIdx.x) * TPB + tid
    while i < V:
        l = logits[i]
        c = counts[i]
        if c > 0:
            if l > 0:
                l = l / rep32
            else:
                l = l * rep32
            # float64: count·freq is exact, so contraction into an FMA cannot change the rounding
            l = np.float32(np.float64(l) - (np.float64(c) * freq + pres))
        if temp > 0.0:
            l = l / t32
        if l == 0:
            l = np.float32(0.0)          # -0.0 -> +0.0: equal values must get equal rank keys
        if masked and (mask[i >> 5] >> (i & 31)) & 1 == 0:
            l = np.float32(-np.inf)
        z[i] = l
        best_v, best_i = _take_max(best_v, best_i, l, i)
        i += cuda.gridDim.x * TPB
    last, bv, bi = _grid_argmax(best_v, best_i, part_val, part_idx, done, D_TRANSFORM)
    if not last:
        return
    for b in range(tid, NB, TPB):
        hist1_cnt[b] = 0
        hist1_mass[b] = 0
        histl_cnt[b] = 0
        histl_mass[b] = 0
    if tid == 0:
        done[D_TRANSFORM] = 0
        for s in range(N_ST):
            st[s] = 0
        stf[F_ZMAX] = np.float64(bv)
        step = np.int64(params[P_STEP])
        stf[F_U] = _philox_uniform(params[P_SEED_LO], params[P_SEED_HI], step)
        params[P_STEP] = np.float64(step + 1)
        if temp > 0.0:
            st[S_PHASE] = PH_HIST1
        else:
            out_token[0] = np.int32(bi)
            st[S_PHASE] = PH_DONE


@cached_jit()
def _update_counts_kernel(counts, out_token):
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        t = out_token[0]
        if t >= 0 and t < counts.shape[0]:
            counts[t] += 1


# ---------------------------------------------------------------- launchers

def argmax(logits, out_token, ws: SampleWorkspace, stream=0) -> None:
    """logits: [V] float32 -> out_token: [1] int32, the first index of the maximum. ws: SampleWorkspace(V)."""
    _argmax_kernel[ws.grid, TPB, stream](logits, ws.part_val, ws.part_idx, ws.done, out_token)


def sample(logits, counts, params, out_token, ws: SampleWorkspace, stream=0) -> None:
    """Draw one token.

    logits: [V] float32 (not modified); counts: [V] int32 occurrences in the penalty window;
    params: [N_PARAMS] float64 from pack_sample_params (its step is advanced by one on the device);
    out_token: [1] int32; ws: SampleWorkspace(V). Temperature 0 gives the argmax of the penalised logits.
    With params' masked flag (pack_sample_params(masked=True)) only tokens whose bit is set in ws.mask
    ([ceil(V/32)] int32, bit i % 32 of word i // 32; a grammar's allowed set) can be drawn.
    """
    g = ws.grid
    _transform_kernel[g, TPB, stream](logits, counts, params, ws.mask, ws.z, ws.part_val, ws.part_idx, ws.done,
                                      ws.st, ws.stf, ws.hist1_cnt, ws.hist1_mass, ws.histl_cnt, ws.histl_mass,
                                      out_token)
    args = (ws.z, ws.zbits, params, ws.st, ws.stf, ws.hist1_cnt, ws.hist1_mass, ws.histl_cnt, ws.histl_mass,
            ws.done, out_token)
    _hist1_kernel[g, TPB, stream](*args)
    refine = _refine_kernel[g, TPB, stream]
    for _ in range(N_REFINE):
        refine(*args)


def update_counts(counts, out_token, stream=0) -> None:
    """counts: [V] int32 += 1 at out_token[0] ([1] int32); ids outside [0, V) are ignored."""
    _update_counts_kernel[1, 32, stream](counts, out_token)
