"""Causal depthwise conv over time with carried state (prefill), fused with SiLU and the q / k L2 norms.

Reference: ``causal_conv1d_ref`` and ``l2norm_ref`` in ref.py (the decode step fuses its one-token conv
into recurrent.py). Two kernels, because the carried state is read by the blocks that start a time tile and
rewritten afterwards: ``conv_silu_norm`` reads the old state, ``conv_state_shift`` (next in the stream)
writes the new one.

``conv_silu_norm``: one thread per channel (every load and store coalesced along C), TPB channels by BT_CONV
tokens per block. A block's channels are whole heads of S (S divides TPB), so the q and k heads are
L2-normalised in the block (shuffles within a warp, one barrier where a head spans warps) and written as
the float16 values the chunk kernels multiply (qk16); v goes out as float32. u never holds q or k.

Layouts: x is the first C = 2·Hk·S + Hv·S columns of a row-major [T, P] projection (row stride P),
w: [C, K], state: [K-1, C] oldest first; qk16: [T, 2·Hk·S] float16, v_out: [T, Hv·S] float32.
"""
import math
from functools import lru_cache

from numba import float32, types

from ninfer_numba.kernels.gdn.device_math import silu_f32
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.reduce import row_sum_f32

TPB = 128          # threads per block: channels
BT_CONV = 32       # tokens per block; the K-1 token halo is re-read per block (3/32 overhead at K = 4)
NLOAD = 8          # tokens loaded before any is used, so several loads are in flight per thread (one at a
                   # time ran at half the copy bandwidth: 255 us for 0.54 GB at 9B / 8K)
float16 = types.float16


@lru_cache(maxsize=None)
def _conv_silu_norm_kernel(K: int, S: int, QK: int):
    """Kernel for K taps (the window lives in registers), head size S, QK = 2·Hk·S q and k channels."""
    if TPB % S != 0:
        raise ValueError(f"head size {S} must divide the conv block's {TPB} channels")
    KM1 = K - 1
    LANES = min(S, 32)           # lanes of a head in one warp
    WPH = max(1, S // 32)        # warps of a head
    N_WARPS = TPB // 32

    @cuda.jit(device=True, inline=True)
    def conv_step(r_w, r_hist):
        """silu(w · window) of the window whose newest token is in r_hist[K-1]; then the window slides."""
        acc = float32(0.0)
        for k in range(K):
            acc += r_w[k] * r_hist[k]
        for k in range(KM1):
            r_hist[k] = r_hist[k + 1]
        return silu_f32(acc)

    @cached_jit()
    def conv_silu_norm(proj, w, state, qk16, v_out, T, C, eps):
        # proj: [T, P] f32 (channels are columns [0, C)), w: [C, K] f32, state: [K-1, C] f32,
        # qk16: [T, QK] f16 (L2-normalised q, k heads), v_out: [T, C - QK] f32
        s_part = cuda.shared.array((N_WARPS, BT_CONV), float32)   # per-warp sums of squares, per token
        ch = cuda.blockIdx.x * TPB + cuda.threadIdx.x
        t0 = cuda.blockIdx.y * BT_CONV
        n_t = min(BT_CONV, T - t0)
        valid = ch < C
        chc = min(ch, C - 1)                          # threads past C compute a copy, never store
        r_w = cuda.local.array(K, float32)
        r_hist = cuda.local.array(K, float32)       # r_hist[k] = x_{t-K+1+k}; slot K-1 takes the new token
        r_x = cuda.local.array(NLOAD, float32)      # a batch of NLOAD tokens of this channel, then its outputs
        for k in range(K):
            r_w[k] = w[chc, k]
        for k in range(KM1):
            s = t0 - KM1 + k                          # token index of this history slot; < 0 reads the state
            r_hist[k] = proj[s, chc] if s >= 0 else state[KM1 + s, chc]
        qk_block = cuda.blockIdx.x * TPB < QK     # the block holds q or k heads (block-uniform)
        warp = cuda.threadIdx.x >> 5
        w0 = warp - warp % WPH                    # the first warp of this thread's head
        eps32 = float32(eps)
        # batches of NLOAD tokens: their loads in flight together, then conv, norms and stores. A runtime trip
        # count keeps the loop rolled: with the tile's 32 tokens unrolled the kernel was 16K SASS instructions
        # (the conv alone: 2.8K) and moved 0.47 GB in 338 us at 9B / 8K, 1.4 TB/s; rolled it is 3.8K
        for tb in range(0, n_t, NLOAD):
            for i in range(NLOAD):
                r_x[i] = proj[t0 + tb + i, chc] if tb + i < n_t else float32(0.0)
            for i in range(NLOAD):
                r_hist[KM1] = r_x[i]
                r_x[i] = conv_step(r_w, r_hist)
            if qk_block:                          # L2 norms: every thread shuffles, q / k channels are scaled
                for i in range(NLOAD):
                    part = row_sum_f32(r_x[i] * r_x[i], LANES)
                    if WPH > 1:
                        if (cuda.threadIdx.x & 31) == 0:
                            s_part[warp, tb + i] = part
                    elif ch < QK:
                        r_x[i] *= float32(1.0) / max(math.sqrt(part), eps32)
                if WPH > 1:                       # a head spans warps: their sums through shared memory
                    cuda.syncthreads()
                    for i in range(NLOAD):
                        tot = float32(0.0)
                        for k in range(WPH):
                            tot += s_part[w0 + k, tb + i]
                        if ch < QK:
                            r_x[i] *= float32(1.0) / max(math.sqrt(tot), eps32)
            if valid:
                for i in range(NLOAD):
                    if tb + i < n_t:
                        if ch < QK:
                            qk16[t0 + tb + i, ch] = float16(r_x[i])
                        else:
                            v_out[t0 + tb + i, ch - QK] = r_x[i]

    return conv_silu_norm


@lru_cache(maxsize=None)
def _conv_state_shift_kernel(K: int):
    KM1 = K - 1

    @cached_jit()
    def conv_state_shift(proj, state, T, C):
        # state[i] <- (state ++ x)[T + i]: ascending i reads slot T + i > i before anything overwrites it
        ch = cuda.blockIdx.x * TPB + cuda.threadIdx.x
        if ch >= C:
            return
        for i in range(KM1):
            s = T + i
            state[i, ch] = proj[s - KM1, ch] if s >= KM1 else state[s, ch]

    return conv_state_shift


def conv_silu_norm_prefill(proj, conv_w, conv_state, qk16, v_out, S: int, eps: float, stream=0) -> None:
    """qk16 = l2norm(q, k heads of u) as float16, v_out = v heads of u, where u = silu(causal_conv1d(
    proj[:, :C], conv_w, conv_state)); conv_state <- last K-1 inputs. Enqueues two kernels.

    proj: [T, P] float32 (conv channels are columns [0, C), C = conv_w.shape[0]), conv_w: [C, K] float32,
    conv_state: [K-1, C] float32 (in/out, oldest first), qk16: [>= T, 2·Hk·S] float16, v_out: [>= T, Hv·S]
    float32, S: head size (divides TPB).
    """
    T = proj.shape[0]
    C, K = conv_w.shape
    QK = qk16.shape[1]
    grid = ((C + TPB - 1) // TPB, (T + BT_CONV - 1) // BT_CONV)
    _conv_silu_norm_kernel(K, S, QK)[grid, TPB, stream](proj, conv_w, conv_state, qk16, v_out, T, C, eps)
    if K > 1:
        _conv_state_shift_kernel(K)[(C + TPB - 1) // TPB, TPB, stream](proj, conv_state, T, C)
