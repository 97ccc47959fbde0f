"""QK-norm + partial NEOX RoPE + KV-cache store: the first kernel of the attention layer.

One block per (token, head slot). Head slots [0, H) are query heads, [H, H+Hkv) key heads and
[H+Hkv, H+2·Hkv) value heads. Query and key heads are RMS-normalised with their shared weight and rotated
on their first n_rot dims at position pos0 + t; value heads are copied. Queries go to ``q_out``, keys and
values into the f16 caches at row pos0 + t. The output gate stays in ``proj`` for the attention epilogue.

θ, cos and sin are computed in float64: in float32, θ = pos·inv_freq at pos ~ 2^15 is off by ~1e-3 rad,
which would show as a 1e-3 relative error in q·k. The cost is n_rot/2 double sincos per head per token.

KV cache layout: [Hkv, max_seq, d] float16, so one KV head's keys are contiguous for decode and prefill.
A coded cache (kernels/kvq) is given as its roles' tuples (KvqTables.role: codes, norms, signs,
thresholds): the block then codes its key or value head itself (kvq/append.py row_coder, from the float16
rounding an f16 cache would store) at the same row, with no float16 copy and no launch of its own.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda

NORM_TPB = 64          # threads per block by default; a head of d = 256 gives 4 elements per thread
MAX_D = 512            # largest head dim held in shared memory


def _f16_store_hooks():
    """(scratch, rows, store, finish_k, finish_v) of a float16 cache: each element stored as it is made."""
    @cuda.jit(device=True, inline=True)
    def scratch():
        return 0

    @cuda.jit(device=True, inline=True)
    def rows(cache):
        return cache.shape[1]

    @cuda.jit(device=True, inline=True)
    def store(cache, sh, head, row, i, x):
        cache[head, row, i] = x

    @cuda.jit(device=True, inline=True)
    def finish(cache, sh, head, row, tid):
        return

    return scratch, rows, store, finish, finish


def _coded_store_hooks(D: int, k_bits: int, v_bits: int, tpb: int):
    """The same for a coded cache (roles' tuples): each thread puts its own elements (tid + tpb·c) in shared
    memory, then the block codes the row from them (row_coder: no barrier needed before; finish_* is
    reached by the whole block)."""
    from ninfer_numba.kernels.kvq.append import put_coordinate, row_coder
    scratch, code_k = row_coder(D, k_bits, tpb)
    _, code_v = row_coder(D, v_bits, tpb)

    @cuda.jit(device=True, inline=True)
    def rows(cache):
        return cache[0].shape[1]

    @cuda.jit(device=True, inline=True)
    def store(cache, sh, head, row, i, x):
        put_coordinate(sh, cache[2], i, x)

    def finisher(code_row):
        @cuda.jit(device=True, inline=True)
        def finish(cache, sh, head, row, tid):
            code_row(sh, cache[3], cache[0], cache[1], head, row, tid)
        return finish

    return scratch, rows, store, finisher(code_k), finisher(code_v)


@lru_cache(maxsize=None)
def _norm_rope_kernel(H: int, Hkv: int, D: int, n_rot: int, batched: bool = False, coded: tuple | None = None,
                      tpb: int = NORM_TPB):
    """Kernel specialised on the head counts and dims (compile-time constants: loops unroll). batched: row t
    is a sequence of its own at position pos_buf[t] with its KV heads in cache slot slots[t]; else the rows
    are consecutive tokens of one sequence from pos_buf[0] (slots unread). coded: (key bits, value bits) of
    a coded cache, whose roles' tuples come in place of k_cache and v_cache. tpb: threads per block."""
    scratch, rows, store, finish_k, finish_v = (_f16_store_hooks() if coded is None
                                                else _coded_store_hooks(D, *coded, tpb))
    HALF = n_rot // 2
    NQG = 2 * D * H                                # proj columns of the interleaved q|gate blocks
    PER_THREAD = (D + tpb - 1) // tpb

    @cached_jit()
    def kernel(proj, q_norm_w, k_norm_w, pos0_buf, slots, q_out, k_cache, v_cache, neg2_log_base_over_rot, eps):
        t = cuda.blockIdx.x
        slot = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        sh = scratch()                                         # a coded row's shared arrays (f16: none)
        s_x = cuda.shared.array(MAX_D, np.float32)            # [D] normalised head, read by RoPE partners
        s_red = cuda.shared.array(tpb, np.float32)            # [tpb] partial sums of squares
        if batched:
            pos = pos0_buf[t]
            kv0 = slots[t] * Hkv                               # the row's sequence's first KV head
        else:
            pos = pos0_buf[0] + t
            kv0 = 0
        max_seq = rows(k_cache)
        if slot >= H + Hkv:                                    # value head: plain f32 -> f16 copy
            kh = slot - H - Hkv
            if pos < max_seq:
                for c in range(PER_THREAD):
                    i = tid + c * tpb
                    if i < D:
                        store(v_cache, sh, kv0 + kh, pos, i, proj[t, NQG + D * Hkv + kh * D + i])
                finish_v(v_cache, sh, kv0 + kh, pos, tid)
            return
        if slot < H:
            col0 = 2 * D * slot                                # query block of head `slot`
        else:
            col0 = NQG + (slot - H) * D
        acc = np.float32(0.0)
        for c in range(PER_THREAD):
            i = tid + c * tpb
            if i < D:
                x = proj[t, col0 + i]
                s_x[i] = x
                acc += x * x
        s_red[tid] = acc
        cuda.syncthreads()
        step = tpb // 2
        while step > 0:                                        # tree reduction, tpb is a power of 2
            if tid < step:
                s_red[tid] += s_red[tid + step]
            cuda.syncthreads()
            step //= 2
        scale = np.float32(1.0) / math.sqrt(s_red[0] / np.float32(D) + eps)
        for c in range(PER_THREAD):
            i = tid + c * tpb
            if i < D:
                w = q_norm_w[i] if slot < H else k_norm_w[i]
                s_x[i] = s_x[i] * scale * w
        cuda.syncthreads()                                     # RoPE reads the partner element
        for c in range(PER_THREAD):
            i = tid + c * tpb
            if i < D:
                y = s_x[i]
                if i < n_rot:
                    pair = i if i < HALF else i - HALF
                    theta = float(pos) * math.exp(float(pair) * neg2_log_base_over_rot)
                    cs = math.cos(theta)
                    sn = math.sin(theta)
                    if i < HALF:
                        y = np.float32(float(y) * cs - float(s_x[i + HALF]) * sn)
                    else:
                        y = np.float32(float(s_x[i - HALF]) * sn + float(y) * cs)
                if slot < H:
                    q_out[t, slot, i] = y
                elif pos < max_seq:
                    store(k_cache, sh, kv0 + slot - H, pos, i, y)
        if slot >= H and pos < max_seq:                        # block-uniform
            finish_k(k_cache, sh, kv0 + slot - H, pos, tid)

    return kernel


def qk_norm_rope_store(proj, q_norm_w, k_norm_w, pos0_buf, q_out, k_cache, v_cache, *, H: int, Hkv: int,
                       n_rot: int, base: float, eps: float, slots=None, threads: int = NORM_TPB,
                       stream=0) -> None:
    """QK-norm + RoPE for T new tokens, queries to q_out, keys and values into the caches.

    proj:     [T, 2·d·H + 2·d·Hkv] float32, columns q_0|g_0|...|q_{H-1}|g_{H-1}|k|v (ref.py docstring)
    q_norm_w: [d] float32; k_norm_w: [d] float32
    pos0_buf: [1] int32 device array, position of row 0 (read on the device: graph-replay safe); with slots,
              [T] int32, the position of each row
    q_out:    [T, H, d] float32 or float16 (written)
    k_cache:  [Hkv, max_seq, d] float16, rows pos0..pos0+T-1 written; v_cache likewise. With slots:
              [n_slots·Hkv, max_seq, d], row t written at its position in the KV heads of slot slots[t].
              Or a coded cache's roles (KvqTables.role: codes [Hkv, max_seq, d·bits/8] uint8, norms
              [Hkv, max_seq] uint16, signs, thresholds): the rows coded there (one sequence only)
    slots:    None (the T rows are consecutive tokens of one sequence), or [T] int32: a batched decode step,
              one token of each of T sequences
    threads:  threads per block, a power of two from 32 to 1024 (the sums of squares, and a coded row's
              rotation, run in another order, so outputs may differ in float32 rounding between sizes)
    Rows whose position is ≥ max_seq are not stored (the caller validates the context length).
    """
    T = proj.shape[0]
    D = q_out.shape[2]
    if T == 0:
        return
    if D > MAX_D or n_rot > D or n_rot % 2:
        raise ValueError(f"unsupported head dim {D} / n_rot {n_rot} (need even n_rot <= d <= {MAX_D})")
    if threads & (threads - 1) or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a power of two from 32 to 1024, not {threads}")
    batched = slots is not None
    if batched and (slots.shape[0] != T or pos0_buf.shape[0] != T):
        raise ValueError(f"batched rows: proj has {T}, slots {slots.shape[0]}, positions {pos0_buf.shape[0]}")
    coded = None
    if isinstance(k_cache, tuple):
        coded = (k_cache[0].shape[2] * 8 // D, v_cache[0].shape[2] * 8 // D)
        if batched or D & (D - 1):
            raise ValueError(f"a coded cache takes one sequence's rows and a power-of-two head dim (d={D})")
    kernel = _norm_rope_kernel(H, Hkv, D, n_rot, batched, coded, threads)
    neg2_log_base_over_rot = -2.0 * math.log(base) / n_rot     # inv_freq(i) = exp(i · this)
    kernel[(T, H + 2 * Hkv), threads, stream](proj, q_norm_w, k_norm_w, pos0_buf, pos0_buf if slots is None
                                               else slots, q_out, k_cache, v_cache, neg2_log_base_over_rot,
                                               np.float32(eps))
