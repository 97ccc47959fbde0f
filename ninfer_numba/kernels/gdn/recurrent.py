"""Fused GDN decode step: conv step + SiLU + L2 norm + gates + delta-rule update; the gated RMSNorm follows
in the kernel that consumes the output (the model's: q8.quant_act.gated_rmsnorm_quant, fused with the
out-projection's quantization; or chunk.gated_norm in float32).

Reference: ``gdn_mixer_ref`` in ref.py at T = 1 (chunked=False).

Work split. The step is bandwidth-bound on the recurrent state (9B: 32 heads x 128 x 128 fp32 = 2 MiB read
and 2 MiB written per layer), and one block per value head would use only Hv SMs. Value columns of the
state are independent in the recurrence (column c of M only needs k, q, beta, g and v[c]), so the grid is
(S / BV value tiles, Hv heads): 128 blocks for 9B, 192 for 27B. Inside a block, thread (col, kgrp) holds
rows [kgrp*ROWS, (kgrp+1)*ROWS) of state column col in registers: the state is read once and written
once, and the two key-dimension sums (M^T k, M^T q) are finished across the KG row groups in shared memory.

Each thread issues the loads of its state slice first, so they are in flight through the conv and L2-norm
phases; block sums are warp butterflies plus one shared word per warp; M^T k and M^T q come from one pass
and one exchange, since o = (M + k delta)^T q = M^T q + delta (k.q). Three barriers in all. (9.3 µs per 9B
layer in the decode profile with a last-tile gated norm, tree sums and the state loaded after the norms; 6.9
µs with the norm moved out, before the single exchange and the early arrival.)

One thing couples blocks: the conv state of a key head's q and k channels is read by every block of the
value heads sharing it, so the last of those blocks to arrive shifts it. A block counts itself in right after
its conv reads (their values are consumed before the barrier that precedes the atomic, and nothing this
kernel writes is read by another block, so no fence is needed), and the flag is acted on at the end.
``sync_counts`` ([B, Hk] int32, zero before the first launch) is reset by that block, so the kernel can
be replayed from a CUDA graph.

Batch: grid z is the batch row b of B sequences stepped at once (a batched decode step): row b reads its
projection proj[b], writes o_out[b] and counts in sync_counts[b]; its conv and recurrent states are slot
slots[b] of [n_slots, ...] slabs, so one captured launch serves any set of active sequences.

State layout (in/out): [n_slots, Hv, S, S] float32, state[slot, j, i_key, i_value] (M_j with math shape [key, value]),
the layout of ref.py; warps read rows along the value index, so loads are coalesced.
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, int32

from ninfer_numba.kernels.gdn.chunk import gated_norm
from ninfer_numba.kernels.gdn.device_math import gate_log_decay, sigmoid_f32, silu_f32
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.pdl import griddep_launch_dependents, griddep_wait
from ninfer_numba.kernels.reduce import row_sum_f32
from ninfer_numba.kernels.numba_env import cuda

KG = 4             # key-row groups per value column


def decode_tiling(S: int) -> tuple[int, int]:
    """(BV value columns per block, threads per block) for head dim S."""
    if S % 16 != 0:
        raise ValueError(f"GDN head dim S={S} must be a multiple of 16")
    BV = 32 if S % 32 == 0 else 16
    return BV, BV * KG


@lru_cache(maxsize=None)
def _decode_kernel(S: int, K: int, Hk: int, Hv: int, batched: bool):
    # batched False (one sequence): row and slot are the constant 0, so the index arithmetic of the batch
    # folds away (128 registers on sm_90 against the batched kernel's 157; 5.9 against 6.2 us per 9B layer)
    if Hv % Hk != 0:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    BV, NT = decode_tiling(S)
    ROWS = S // KG
    NTILES = S // BV
    KM1 = K - 1
    NW = NT // 32               # warps per block
    S2 = 2 * S                  # shared-array sizes must be plain constants, not expressions
    C = 2 * Hk * S + Hv * S
    B0 = C + Hv * S             # proj column of beta_raw (after z); alpha_raw follows at B0 + Hv
    KEY_BLOCKS = NTILES * (Hv // Hk)
    SCALE = 1.0 / math.sqrt(S)

    @cached_jit(pdl=True)
    def gdn_decode(proj, conv_w, conv_state, ssm_a, dt_bias, state, o_out, sync_counts, slots, eps):
        # proj: [B, P] f32, conv_w: [C, K] f32, conv_state: [n_slots, K-1, C] f32 (in/out), ssm_a, dt_bias:
        # [Hv] f32, state: [n_slots, Hv, S, S] f32 (in/out), o_out: [B, Hv*S] f32 (raw o / sqrt(S)),
        # sync_counts: [B, Hk] i32, slots: [B] i32 (batch row -> state slot)
        griddep_wait()                                # kernels/pdl.py: before any global access
        griddep_launch_dependents()
        tid = cuda.threadIdx.x
        vt = cuda.blockIdx.x
        j = cuda.blockIdx.y
        row = cuda.blockIdx.z if batched else 0       # batch row: its token, output and arrival counters
        slot = slots[row] if batched else 0           # its sequence's conv and recurrent states
        kh = j % Hk                                   # tiled head broadcast (ggml / converter order)
        col = tid % BV
        kgrp = tid // BV
        lane = tid % 32
        warp = tid // 32
        s_qk = cuda.shared.array(S2, float32)      # silu(conv) of q | k for key head kh, then normalised
        s_v = cuda.shared.array(BV, float32)
        s_red_a = cuda.shared.array(NW, float32)      # [warps] partial sums of squares of q, then k
        s_red_b = cuda.shared.array(NW, float32)
        s_red_c = cuda.shared.array(NW, float32)      # [warps] partial raw k.q
        s_part = cuda.shared.array(NT, float32)       # [KG, BV] partial M^T k over this thread's key rows
        s_part_q = cuda.shared.array(NT, float32)     # [KG, BV] partial M^T q
        s_flag = cuda.shared.array(1, int32)
        r_x = cuda.local.array(K, float32)
        r_m = cuda.local.array(ROWS, float32)         # this thread's ROWS x 1 slice of state column vcol
        epsf = float32(eps)
        vcol = vt * BV + col
        i0 = kgrp * ROWS

        # --- the state slice first: its loads (the kernel's bytes) are in flight through the conv phase
        for r in range(ROWS):
            r_m[r] = state[slot, j, i0 + r, vcol]

        # --- conv step + SiLU: q, k channels of key head kh (read-only here), v channels of this tile
        for c in range(tid, 2 * S, NT):
            ch = kh * S + c if c < S else Hk * S + kh * S + (c - S)
            acc = conv_w[ch, KM1] * proj[row, ch]
            for k in range(KM1):
                acc += conv_w[ch, k] * conv_state[slot, k, ch]
            s_qk[c] = silu_f32(acc)
        if tid < BV:
            ch = 2 * Hk * S + j * S + vt * BV + tid  # owned by this block alone: shift in place
            for k in range(KM1):
                r_x[k] = conv_state[slot, k, ch]
            r_x[KM1] = proj[row, ch]
            acc = float32(0.0)
            for k in range(K):
                acc += conv_w[ch, k] * r_x[k]
            s_v[tid] = silu_f32(acc)
            for k in range(KM1):
                conv_state[slot, k, ch] = r_x[k + 1]
        cuda.syncthreads()

        # --- arrival: this block has read its key head's q/k conv state (the barrier above); the last of the
        #     key head's blocks to arrive shifts it at the end (the flag is read after the next barrier)
        if tid == 0:
            s_flag[0] = 1 if cuda.atomic.add(sync_counts, (row, kh), 1) == KEY_BLOCKS - 1 else 0

        # --- L2 norms of q and k (x / max(||x||, eps)) and the raw k.q: a butterfly per warp, the warps' sums
        #     in order
        pa = float32(0.0)
        pb = float32(0.0)
        pc = float32(0.0)
        for c in range(tid, S, NT):
            pa += s_qk[c] * s_qk[c]
            pb += s_qk[S + c] * s_qk[S + c]
            pc += s_qk[c] * s_qk[S + c]
        pa = row_sum_f32(pa, 32)
        pb = row_sum_f32(pb, 32)
        pc = row_sum_f32(pc, 32)
        if lane == 0:
            s_red_a[warp] = pa
            s_red_b[warp] = pb
            s_red_c[warp] = pc
        cuda.syncthreads()
        ssq_q = float32(0.0)
        ssq_k = float32(0.0)
        kq = float32(0.0)
        for w in range(NW):
            ssq_q += s_red_a[w]
            ssq_k += s_red_b[w]
            kq += s_red_c[w]
        inv_q = float32(1.0) / max(float32(math.sqrt(ssq_q)), epsf)
        inv_k = float32(1.0) / max(float32(math.sqrt(ssq_k)), epsf)
        kq = (kq * inv_q) * inv_k                     # k.q of the normalised vectors
        beta = sigmoid_f32(proj[row, B0 + j])
        decay = float32(math.exp(gate_log_decay(proj[row, B0 + Hv + j], ssm_a[j], dt_bias[j])))

        # --- delta rule on the slice, one exchange: with M = decay * state, kv = M^T k and mq = M^T q over the
        #     column; delta = beta (v - kv); o = (M + k delta)^T q = mq + delta (k.q); M' = M + k delta
        acc_k = float32(0.0)
        acc_q = float32(0.0)
        for r in range(ROWS):
            m = r_m[r] * decay
            r_m[r] = m
            acc_k += m * (s_qk[S + i0 + r] * inv_k)
            acc_q += m * (s_qk[i0 + r] * inv_q)
        s_part[tid] = acc_k
        s_part_q[tid] = acc_q
        cuda.syncthreads()
        kv = float32(0.0)
        mq = float32(0.0)
        for g in range(KG):
            kv += s_part[g * BV + col]
            mq += s_part_q[g * BV + col]
        delta = beta * (s_v[col] - kv)
        if kgrp == 0:
            o_out[row, j * S + vcol] = (mq + delta * kq) * float32(SCALE)
        for r in range(ROWS):
            state[slot, j, i0 + r, vcol] = r_m[r] + (s_qk[S + i0 + r] * inv_k) * delta

        if s_flag[0] != 0:
            for c in range(tid, 2 * S, NT):
                ch = kh * S + c if c < S else Hk * S + kh * S + (c - S)
                for k in range(KM1 - 1):
                    conv_state[slot, k, ch] = conv_state[slot, k + 1, ch]
                if KM1 > 0:
                    conv_state[slot, KM1 - 1, ch] = proj[row, ch]
            if tid == 0:
                sync_counts[row, kh] = 0

    return gdn_decode


@dataclass(frozen=True)
class DecodeSync:
    """What a decode launch needs beside its data: ``counts`` [B, Hk] int32 arrival counters (zero before the
    first launch, left zeroed by every launch) and ``slots`` [B] int32, the state slot of each batch row (the
    identity until an engine writes its active sequences there; a CUDA graph replays whatever it holds)."""
    counts: object
    slots: object

    @property
    def batch(self) -> int:
        return self.slots.shape[0]


def make_decode_sync(Hk: int, batch: int = 1, stream=0) -> DecodeSync:
    """Zeroed counters and identity slots for decode launches of ``batch`` rows; one per concurrently running
    layer. Allocated ahead of any CUDA-graph capture (the capture cannot copy to the device)."""
    return DecodeSync(cuda.to_device(np.zeros((batch, Hk), np.int32), stream=stream),
                      cuda.to_device(np.arange(batch, dtype=np.int32), stream=stream))


def gdn_decode_step(proj, conv_w, conv_state, ssm_a, dt_bias, norm_w, state, y_out, sync: DecodeSync,
                    Hk: int, eps: float, stream=0, normalize: bool = True) -> None:
    """One decode token of each of B sequences through the GDN mixer (see the module docstring); one
    sequence's states ([K-1, C], [Hv, S, S]) take a kernel without the slot table (row and slot constant).

    proj: [B, P] or [P] float32 (qkv | z | beta_raw | alpha_raw, P = C + Hv*S + 2*Hv), conv_w: [C, K]
    float32, conv_state: [n_slots, K-1, C] or [K-1, C] float32 (in/out), ssm_a, dt_bias: [Hv] float32,
    norm_w: [S] float32, state: [n_slots, Hv, S, S] or [Hv, S, S] float32 (in/out, state[slot, j, key,
    value]), y_out: [B, Hv*S] or [Hv*S] float32, sync: make_decode_sync(Hk, B) (row b uses slot
    sync.slots[b]). normalize: y_out gets the gated RMSNorm (prefill's gated_norm kernel, a second launch);
    False leaves the raw o for a consumer that fuses the norm (q8.quant_act.gated_rmsnorm_quant, the
    model's decode step).
    """
    one = state.ndim == 3                                 # one sequence's states: row 0, no slot table
    if one:
        conv_state, state = conv_state.reshape((1,) + conv_state.shape), state.reshape((1,) + state.shape)
    if proj.ndim == 1:
        proj, y_out = proj.reshape(1, -1), y_out.reshape(1, -1)
    B = proj.shape[0]
    if sync.batch != B or y_out.shape[0] != B or (one and B != 1):
        raise ValueError(f"decode batch: proj has {B} rows, y_out {y_out.shape[0]}, sync {sync.batch}"
                         + (" (B rows need [n_slots, ...] state slabs)" if one and B != 1 else ""))
    Hv, S = state.shape[1], state.shape[2]
    BV, NT = decode_tiling(S)
    _decode_kernel(S, conv_w.shape[1], Hk, Hv, not one)[(S // BV, Hv, B), NT, stream](
        proj, conv_w, conv_state, ssm_a, dt_bias, state, y_out, sync.counts, sync.slots, eps)
    if normalize:
        gated_norm(proj, norm_w, y_out, B, Hk, eps, stream=stream)
