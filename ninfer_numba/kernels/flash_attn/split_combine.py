"""The combine of a split-K decode attention, shared by the f16 cache (flash_attn/decode.py) and the coded
caches (kvq/decode.py): each of ``n_splits`` blocks of a partial kernel leaves, per query head, an
unnormalised output o_s [D] and its running (m_s, l_s), m in the log2 domain (p = 2^(x - m)). The combine
rescales the partials of one head by 2^(m_s - M), sums them, divides by Σ l_s 2^(m_s - M) and, when gated,
multiplies by σ(gate).

Splits are contiguous ranges of split_range_len(kv_len, n_splits, step) keys; those past kv_len did not run
and are never read, so the partial kernels may leave them unwritten.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.reduce import row_max_f32, row_sum_f32

COMB_GROUPS = 16                  # split groups (warps) of a combine block
COMB_TPB = 32 * COMB_GROUPS       # threads per block of the combine kernel
NEG_INF = -math.inf


@cuda.jit(device=True)
def split_range_len(kv_len, n_splits, step_rows):
    """Keys per split: ceil(kv_len / n_splits) rounded up to whole block steps of the partial kernel."""
    per = (kv_len + n_splits - 1) // n_splits
    return ((per + step_rows - 1) // step_rows) * step_rows


@lru_cache(maxsize=None)
def split_combine_kernel(D: int, n_splits: int, step: int, gated: bool = True):
    """The combine for heads of D dims after a partial kernel whose splits are split_range_len(kv_len,
    n_splits, step) keys long; launch it with grid (H, ceil(D / 32), B) and COMB_TPB threads."""
    @cached_jit(pdl=True)
    def combine_kernel(part_o, part_ml, kv_len_buf, proj, out):
        # part_o [B, n_splits, H, D] f32, part_ml [B, n_splits, H, 2] f32 (m in the log2 domain, l), kv_len_buf
        # [B] int32, proj [B, P] f32 (gated: the gate of head h at [2Dh + D, 2D(h + 1)); else unread), out
        # [B, H·D] f32. grid (H, ceil(D / 32), B: the batch row), COMB_TPB threads: warp g sums splits g, g + COMB_GROUPS, ... of dims
        # [32 y, 32 y + 32) (lane = dim; two loads in flight per step), then warp 0 adds the groups in order.
        # One thread per dim walking every split was a chain of n_splits dependent loads: 18 µs per layer.
        griddep_wait()                                # kernels/pdl.py: before any global access
        griddep_launch_dependents()
        h = cuda.blockIdx.x
        b = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        g = tid // 32
        lane = tid - 32 * g
        i = 32 * cuda.blockIdx.y + lane
        kv_len = kv_len_buf[b]
        per = split_range_len(kv_len, n_splits, step)
        n_act = (kv_len + per - 1) // per                     # splits that ran (all others returned early)
        s_w = cuda.shared.array(n_splits, np.float32)          # [n_splits] weights 2^(m_s − M)
        s_l = cuda.shared.array(n_splits, np.float32)          # [n_splits] l_s 2^(m_s − M)
        s_o = cuda.shared.array(COMB_TPB, np.float32)          # [COMB_GROUPS, 32] the groups' sums
        m_all = np.float32(NEG_INF)                            # every warp finds the maximum itself
        for e in range(lane, n_act, 32):
            m_all = max(m_all, part_ml[b, e, h, 0])
        m_all = row_max_f32(m_all, 32)
        for e in range(tid, n_act, COMB_TPB):
            wt = math.exp2(part_ml[b, e, h, 0] - m_all)
            s_w[e] = wt
            s_l[e] = part_ml[b, e, h, 1] * wt
        cuda.syncthreads()
        o0 = np.float32(0.0)
        o1 = np.float32(0.0)
        if i < D:
            e = g
            while e + COMB_GROUPS < n_act:
                o0 += part_o[b, e, h, i] * s_w[e]
                o1 += part_o[b, e + COMB_GROUPS, h, i] * s_w[e + COMB_GROUPS]
                e += 2 * COMB_GROUPS
            if e < n_act:
                o0 += part_o[b, e, h, i] * s_w[e]
        s_o[tid] = o0 + o1
        cuda.syncthreads()
        if g == 0:
            l_all = np.float32(0.0)
            for e in range(lane, n_act, 32):
                l_all += s_l[e]
            l_all = row_sum_f32(l_all, 32)
            o = np.float32(0.0)
            for u in range(COMB_GROUPS):
                o += s_o[32 * u + lane]
            if i < D:
                o = o * (np.float32(1.0) / l_all)
                if gated:
                    o = o / (np.float32(1.0) + math.exp(-proj[b, 2 * D * h + D + i]))
                out[b, h * D + i] = o
    return combine_kernel
