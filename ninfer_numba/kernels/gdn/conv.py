"""Causal depthwise conv over time with carried state (prefill), fused with SiLU and the q / k L2 norms.

Reference: ``causal_conv1d_ref`` and ``l2norm_ref`` in ref.py (the decode step fuses its one-token conv
into recurrent.py). Two kernels, because the carried state is read by the blocks that start a time tile and
rewritten afterwards: ``conv_silu_norm`` reads the old state, ``conv_state_shift`` (next in the stream)
writes the new one.

``conv_silu_norm``: one thread per channel (every load and store coalesced along C), TPB channels by BT_CONV
tokens per block, NLOAD tokens at a time. A block's channels are whole heads of S (S divides TPB), so the
q and k heads are L2-normalised in the block: each lane group sums its squares of the NLOAD tokens at once
(``group_sums``), HPB·NLOAD threads turn the group sums into the inverse norms, and the q and k values are
written as the float16 values the chunk kernels multiply (qk16); v goes out as float32. u never holds q or
k.

Layouts: x is the first C = 2·Hk·S + Hv·S columns of a row-major [T, P] projection (row stride P),
w: [C, K], state: [K-1, C] oldest first; qk16: [T, 2·Hk·S] float16, v_out: [T, Hv·S] float32.
"""
import math
from functools import lru_cache

from numba import float32, types, uint64

from ninfer_numba.kernels.gdn.device_math import silu_f32
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.ptx import shfl_xor_f32

TPB = 128          # threads per block: channels
BT_CONV = 32       # tokens per block; the K-1 token halo is re-read per block (3/32 overhead at K = 4)
NLOAD = 4          # tokens loaded before any is used, so several loads are in flight per thread (one at a
                   # time ran at half the copy bandwidth: 255 us for 0.54 GB at 9B / 8K). 8 took 96
                   # registers (5 blocks per SM, 204 us, DRAM 46 %); 4 takes 61 (8 blocks per SM)
float16 = types.float16


@lru_cache(maxsize=None)
def _conv_silu_norm_kernel(K: int, S: int, QK: int):
    """Kernel for K taps (the window lives in registers), head size S, QK = 2·Hk·S q and k channels."""
    if TPB % S != 0 or S < NLOAD:
        raise ValueError(f"head size {S} must divide the conv block's {TPB} channels and be >= {NLOAD}")
    KM1 = K - 1
    LANES = min(S, 32)             # lanes of a head in one warp: a lane group
    GROUPS = TPB // LANES          # lane groups in the block
    WPH = max(1, S // 32)          # lane groups (warps) of a head
    HPB = TPB // S                 # heads in the block
    SPLITS = NLOAD.bit_length() - 1        # butterfly steps that halve the values a lane holds
    TOK_LANES = LANES // NLOAD     # lanes of a group that end up holding the same token's sum

    @cuda.jit(device=True, inline=True)
    def conv_step(r_w, r_hist):
        """silu(w · window) of the window whose newest token is in r_hist[K-1]; then the window slides."""
        acc = float32(0.0)
        for k in range(K):
            acc += r_w[k] * r_hist[k]
        for k in range(KM1):
            r_hist[k] = r_hist[k + 1]
        return silu_f32(acc)

    @cuda.jit(device=True, inline=True)
    def group_sums(r_sq, lane):
        """The sums over the lane group of r_sq[0..NLOAD) (each lane's squares of NLOAD tokens), returned in
        r_sq[0]: lane l gets token (l % LANES) // TOK_LANES. Each splitting step sends half the values and
        keeps the other half (at NLOAD 4: 2 + 1 shuffles), then the rest is a plain butterfly: 6 shuffles for
        4 tokens at 32 lanes where one butterfly a token is 20, and the same sums bit for bit (the same pairs
        are added)."""
        half = NLOAD // 2
        m = LANES // 2
        for _ in range(SPLITS):
            upper = (lane & m) != 0
            for j in range(half):
                send = r_sq[j] if upper else r_sq[j + half]
                keep = r_sq[j + half] if upper else r_sq[j]
                r_sq[j] = keep + shfl_xor_f32(send, m)
            half //= 2
            m //= 2
        while m > 0:
            r_sq[0] += shfl_xor_f32(r_sq[0], m)
            m //= 2

    @cached_jit()
    def conv_silu_norm(proj, w, state, qk16, v_out, T, C, eps):
        # proj: [T, P] f32 (channels are columns [0, C)), w: [C, K] f32, state: [K-1, C] f32,
        # qk16: [T, QK] f16 (L2-normalised q, k heads), v_out: [T, C - QK] f32
        s_part = cuda.shared.array((GROUPS, NLOAD), float32)  # a lane group's sums of squares, per token
        s_inv = cuda.shared.array((HPB, NLOAD), float32)      # 1 / max(|head|, eps), per head and token
        tid = cuda.threadIdx.x
        lane = tid & 31
        ch = cuda.blockIdx.x * TPB + tid
        t0 = cuda.blockIdx.y * BT_CONV
        n_t = min(BT_CONV, T - t0)
        valid = ch < C
        chc = min(ch, C - 1)                          # threads past C compute a copy, never store
        uchc = uint64(chc)                            # unsigned indices skip numba's negative-index fix-up
        r_w = cuda.local.array(K, float32)
        r_hist = cuda.local.array(K, float32)       # r_hist[k] = x_{t-K+1+k}; slot K-1 takes the new token
        r_x = cuda.local.array(NLOAD, float32)      # a batch of NLOAD tokens of this channel, then its outputs
        r_sq = cuda.local.array(NLOAD, float32)     # their squares, then the group's sums (group_sums)
        for k in range(K):
            r_w[k] = w[chc, k]
        for k in range(KM1):
            s = t0 - KM1 + k                          # token index of this history slot; < 0 reads the state
            r_hist[k] = proj[s, chc] if s >= 0 else state[KM1 + s, chc]
        qk_block = cuda.blockIdx.x * TPB < QK     # the block holds q or k heads (block-uniform)
        head = tid // S                           # this thread's head in the block
        eps32 = float32(eps)
        # batches of NLOAD tokens: their loads in flight together, then conv, norms and stores. A runtime trip
        # count keeps the loop rolled (the tile's 32 tokens unrolled were 16K SASS instructions). The norm's
        # square root and division run once per (head, token) on HPB·NLOAD threads, not once per channel:
        # per channel they were most of the kernel's instructions (it issued at 85% of the SMs' peak)
        for tb in range(0, n_t, NLOAD):
            n_b = min(NLOAD, n_t - tb)            # tokens of this batch inside the tile
            for i in range(NLOAD):
                r_x[i] = proj[uint64(t0 + tb + i), uchc] if i < n_b else float32(0.0)
            for i in range(NLOAD):
                r_hist[KM1] = r_x[i]
                r_x[i] = conv_step(r_w, r_hist)
            if qk_block:                          # L2 norms: every thread shuffles, q / k channels are scaled
                for i in range(NLOAD):
                    r_sq[i] = r_x[i] * r_x[i]
                group_sums(r_sq, lane)
                if lane % TOK_LANES == 0:
                    s_part[tid // LANES, (lane % LANES) // TOK_LANES] = r_sq[0]
                cuda.syncthreads()
                if tid < HPB * NLOAD:             # a head's groups summed in order, as a butterfly per warp
                    h = tid // NLOAD
                    j = tid % NLOAD
                    tot = float32(0.0)
                    for k in range(WPH):
                        tot += s_part[h * WPH + k, j]
                    s_inv[h, j] = float32(1.0) / max(math.sqrt(tot), eps32)
                cuda.syncthreads()                # the next batch writes s_inv only after its first barrier
                if ch < QK:
                    for i in range(NLOAD):
                        r_x[i] *= s_inv[head, i]
            if valid and ch < QK:
                for i in range(NLOAD):
                    if i < n_b:
                        qk16[uint64(t0 + tb + i), uchc] = float16(r_x[i])
            elif valid:
                for i in range(NLOAD):
                    if i < n_b:
                        v_out[uint64(t0 + tb + i), uint64(ch - QK)] = r_x[i]

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
