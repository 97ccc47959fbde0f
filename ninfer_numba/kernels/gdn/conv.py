"""Causal depthwise conv over time with carried state (prefill), fused with SiLU.

Reference: ``causal_conv1d_ref`` in ref.py (the decode step fuses its one-token conv into
recurrent.py). Two kernels, because the carried state is read by the blocks that start a time tile and
rewritten afterwards: ``conv_silu`` reads the old state, ``conv_state_shift`` (next in the stream) writes
the new one.

Layouts: x is the first C columns of a row-major [T, P] projection (row stride P), w: [C, K],
state: [K-1, C] oldest first. One thread per channel so every load and store is coalesced along C.
"""
from functools import lru_cache

from numba import float32

from ninfer_numba.kernels.gdn.device_math import silu_f32
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda

TPB = 128          # threads per block: channels
BT_CONV = 32       # tokens per block; the K-1 token halo is re-read per block (3/32 overhead at K = 4)
NLOAD = 8          # tokens loaded before any is used, so several loads are in flight per thread (one at a
                   # time ran at half the copy bandwidth: 255 us for 0.54 GB at 9B / 8K)


@lru_cache(maxsize=None)
def _conv_silu_kernel(K: int):
    """Kernel specialised for K taps (the window lives in registers)."""
    KM1 = K - 1

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
    def conv_silu(proj, w, state, u, T, C):
        # proj: [T, P] f32 (channels are columns [0, C)), w: [C, K] f32, state: [K-1, C] f32, u: [T, C] f32
        ch = cuda.blockIdx.x * TPB + cuda.threadIdx.x
        t0 = cuda.blockIdx.y * BT_CONV
        if ch >= C:
            return
        r_w = cuda.local.array(K, float32)
        r_hist = cuda.local.array(K, float32)       # r_hist[k] = x_{t-K+1+k}; slot K-1 takes the new token
        r_x = cuda.local.array(NLOAD, float32)      # the next NLOAD tokens of this channel
        for k in range(K):
            r_w[k] = w[ch, k]
        for k in range(KM1):
            s = t0 - KM1 + k                          # token index of this history slot; < 0 reads the state
            r_hist[k] = proj[s, ch] if s >= 0 else state[KM1 + s, ch]
        if t0 + BT_CONV <= T:                     # a full tile: NLOAD loads in flight before their use
            for tb in range(0, BT_CONV, NLOAD):
                for i in range(NLOAD):
                    r_x[i] = proj[t0 + tb + i, ch]
                for i in range(NLOAD):
                    r_hist[KM1] = r_x[i]
                    u[t0 + tb + i, ch] = conv_step(r_w, r_hist)
        else:
            for t in range(t0, T):
                r_hist[KM1] = proj[t, ch]
                u[t, ch] = conv_step(r_w, r_hist)

    return conv_silu


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


def conv_silu_prefill(proj, conv_w, conv_state, u_out, n_channels: int, stream=0) -> None:
    """u_out = silu(causal_conv1d(proj[:, :C], conv_w, conv_state)); conv_state <- last K-1 inputs.

    proj: [T, P] float32 (conv channels are columns [0, C), C = n_channels), conv_w: [C, K] float32,
    conv_state: [K-1, C] float32 (in/out, oldest first), u_out: [T, C] float32. Enqueues two kernels.
    """
    T = proj.shape[0]
    K = conv_w.shape[1]
    C = n_channels
    grid = ((C + TPB - 1) // TPB, (T + BT_CONV - 1) // BT_CONV)
    _conv_silu_kernel(K)[grid, TPB, stream](proj, conv_w, conv_state, u_out, T, C)
    if K > 1:
        _conv_state_shift_kernel(K)[(C + TPB - 1) // TPB, TPB, stream](proj, conv_state, T, C)
