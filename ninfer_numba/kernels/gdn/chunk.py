"""GDN prefill (chunked form): the whole token mixer for T tokens, as a sequence of kernels on one stream.

Reference: ``gdn_mixer_ref`` in ref.py (chunked=True). Order, each kernel reading what the previous wrote:
  1. conv_silu + conv_state_shift (conv.py)   u = silu(conv(proj[:, :C])), conv state <- last K-1 inputs
  2. qk_norm_gates                             q, k heads of u L2-normalised, as float16 (qk16); beta, g [T, Hv]
  3. chunk_intra_mma (chunk_intra_mma.py)     G, W, U, P per (chunk, value head), tensor cores (3xTF32)
  4. chunk_state_f16 (chunk_state_f16.py)     raw o into y_out; state carried over all chunks, f16 tensor cores
  5. gated_norm                                y_out <- RMSNorm(o) * w * silu(z), in place (or, normalize=False,
                                               in the kernel making the out-projection's activation)
All intermediates live in a ``GdnPrefillWorkspace`` sized for the longest prompt; kernels receive the full
workspace arrays plus T and touch rows < T only. Callers that must never allocate pass ``ws``; without it
one workspace per (device, shape) is kept here and grown to the longest T seen (allocation then happens
only on a first or longer call, never during graph capture of decode, which does not use it).
"""
import math
from functools import lru_cache

import numpy as np
from numba import float32, types

from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.gdn.chunk_intra_mma import launch_chunk_intra_mma
from ninfer_numba.kernels.gdn.chunk_state_f16 import launch_chunk_state_f16
from ninfer_numba.kernels.gdn.conv import conv_silu_prefill
from ninfer_numba.kernels.gdn.device_math import gate_log_decay, gated_rms_apply, gated_rms_inverse, sigmoid_f32
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.reduce import row_sum_f32

WARPS_ROW = 4      # warps per block of the row kernels
float16 = types.float16


def lanes_per_row(S: int) -> int:
    """Lanes sharing one head row in the row kernels: a power of two <= 32 leaving each lane >= 4 elements
    (S = 128: a full warp per row; the simulator's S = 16: 4 lanes, 8 rows per warp)."""
    n = 1
    while n * 2 <= 32 and n * 2 * 4 <= S:
        n *= 2
    return n


@lru_cache(maxsize=None)
def _qk_norm_gates_kernel(S: int, Hk: int, Hv: int):
    C = 2 * Hk * S + Hv * S
    B0 = C + Hv * S            # proj column of beta_raw; alpha_raw follows at B0 + Hv
    LPR = lanes_per_row(S)
    NG = (Hv + LPR - 1) // LPR  # gate items per token (one gate per lane)
    NR = 2 * Hk + NG           # items per token: 2*Hk L2 norms (q heads, then k heads), then gates
    NPL = (S + LPR - 1) // LPR  # elements per lane of a head row

    @cached_jit()
    def qk_norm_gates(proj, u, qk16, ssm_a, dt_bias, beta, g, T, eps):
        # proj: [T, P], u: [T, C] (read), qk16: [T, 2·Hk·S] f16 the L2-normalised q, k heads of u (the float16
        # values both chunk kernels multiply), ssm_a, dt_bias: [Hv], beta, g: [T, Hv]
        # LPR lanes per item; a head row's lanes read consecutive columns (coalesced) and reduce by shuffles,
        # which every lane executes (items of one warp may differ in kind or be past the end).
        gid = cuda.blockIdx.x * (32 * WARPS_ROW) + cuda.threadIdx.x
        item = gid // LPR
        lane = gid % LPR
        t = item // NR
        r = item % NR
        norm_row = item < T * NR and r < 2 * Hk
        base = r * S
        acc = float32(0.0)
        if norm_row:
            for k in range(NPL):
                d = lane + LPR * k
                if d < S:
                    x = u[t, base + d]
                    acc += x * x
        acc = row_sum_f32(acc, LPR)
        if norm_row:
            inv = float32(1.0) / max(float32(math.sqrt(acc)), float32(eps))
            for k in range(NPL):
                d = lane + LPR * k
                if d < S:
                    qk16[t, base + d] = float16(u[t, base + d] * inv)
        elif item < T * NR:
            jj = (r - 2 * Hk) * LPR + lane
            if jj < Hv:
                beta[t, jj] = sigmoid_f32(proj[t, B0 + jj])
                g[t, jj] = gate_log_decay(proj[t, B0 + Hv + jj], ssm_a[jj], dt_bias[jj])

    return qk_norm_gates, NR


@lru_cache(maxsize=None)
def _gated_norm_kernel(S: int, Hk: int, Hv: int):
    Z0 = 2 * Hk * S + Hv * S   # proj column of z
    LPR = lanes_per_row(S)
    NPL = (S + LPR - 1) // LPR

    @cached_jit()
    def gated_norm(proj, norm_w, y, T, eps):
        # y: [T, Hv*S] raw o in, RMSNorm(o) * norm_w * silu(z) out; norm_w: [S]; LPR lanes per (t, head)
        gid = cuda.blockIdx.x * (32 * WARPS_ROW) + cuda.threadIdx.x
        item = gid // LPR
        lane = gid % LPR
        valid = item < T * Hv
        t = item // Hv
        base = (item % Hv) * S
        acc = float32(0.0)
        if valid:
            for k in range(NPL):
                d = lane + LPR * k
                if d < S:
                    o = y[t, base + d]
                    acc += o * o
        acc = row_sum_f32(acc, LPR)          # every lane: shuffles need the whole warp
        if valid:
            inv_rms = gated_rms_inverse(acc, S, eps)
            for k in range(NPL):
                d = lane + LPR * k
                if d < S:
                    y[t, base + d] = gated_rms_apply(y[t, base + d], inv_rms, norm_w[d], proj[t, Z0 + base + d])

    return gated_norm


class GdnPrefillWorkspace:
    """Device scratch for gdn_prefill up to ``max_tokens`` tokens (reused by every GDN layer in turn).

    u: [T, C] post-conv activations, qk16: [T, 2·Hk·S] its q, k heads as float16, beta, g: [T, Hv],
    G: [Hv, T], U: [Hv, T, S] float32; W16: [Hv, T, S], P16: [Hv, T, BT] float16.
    9B at T = 8192: u 268, qk16 67, U 134, W16 67, P16 34 MB.
    """

    def __init__(self, max_tokens: int, Hk: int, Hv: int, S: int, stream=0) -> None:
        self.max_tokens, self.Hk, self.Hv, self.S = max_tokens, Hk, Hv, S
        C = 2 * Hk * S + Hv * S
        T = max_tokens
        f32 = np.float32
        self.u = cuda.device_array((T, C), f32, stream=stream)
        self.beta = cuda.device_array((T, Hv), f32, stream=stream)
        self.g = cuda.device_array((T, Hv), f32, stream=stream)
        self.G = cuda.device_array((Hv, T), f32, stream=stream)
        self.qk16 = cuda.device_array((T, 2 * Hk * S), np.float16, stream=stream)
        self.W16 = cuda.device_array((Hv, T, S), np.float16, stream=stream)
        self.U = cuda.device_array((Hv, T, S), f32, stream=stream)
        self.P16 = cuda.device_array((Hv, T, BT), np.float16, stream=stream)

    def arrays(self) -> tuple:
        return self.u, self.qk16, self.beta, self.g, self.G, self.W16, self.U, self.P16

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


_SHARED_WORKSPACES: dict = {}


def shared_workspace(T: int, Hk: int, Hv: int, S: int, stream=0) -> GdnPrefillWorkspace:
    """The module's workspace for the current device and shape, grown (rounded up to BT) to hold T."""
    device_id = 0 if SIMULATOR else cuda.get_current_device().id     # the simulator's device has no id
    key = (device_id, Hk, Hv, S)
    ws = _SHARED_WORKSPACES.get(key)
    if ws is None or ws.max_tokens < T:
        ws = GdnPrefillWorkspace((T + BT - 1) // BT * BT, Hk, Hv, S, stream=stream)
        _SHARED_WORKSPACES[key] = ws
    return ws


def gdn_prefill(proj, conv_w, conv_state, ssm_a, dt_bias, norm_w, state, y_out, Hk: int, eps: float,
                stream=0, ws: GdnPrefillWorkspace | None = None, normalize: bool = True,
                state_bv: int | None = None) -> None:
    """T tokens through the whole GDN mixer (chunked form); leaves conv_state and state ready for decode.

    proj: [T, P] float32 (qkv | z | beta_raw | alpha_raw, P = C + Hv*S + 2*Hv), conv_w: [C, K] float32,
    conv_state: [K-1, C] float32 (in/out), ssm_a, dt_bias: [Hv] float32, norm_w: [S] float32,
    state: [Hv, S, S] float32 (in/out, state[j, key, value]), y_out: [T, Hv*S] float32.
    ws: scratch (max_tokens >= T, same Hk, Hv, S); None uses the shared one (see the module docstring).
    Layers on one stream may share a workspace; concurrent streams on one device need one each.
    normalize: False leaves the raw o in y_out (step 5 skipped) for a consumer that fuses the gated RMSNorm
    into the next matmul's activation (q8.act_f16.gated_rmsnorm_f16, q8.quant_act.gated_rmsnorm_quant).
    state_bv: value columns per block of the state pass (chunk_state_f16.state_tile's default when None).
    """
    T = proj.shape[0]
    Hv, S = state.shape[0], state.shape[1]
    if T == 0:
        return
    if ws is None:
        ws = shared_workspace(T, Hk, Hv, S, stream)
    if T > ws.max_tokens or (ws.Hk, ws.Hv, ws.S) != (Hk, Hv, S):
        raise ValueError(f"workspace (T<={ws.max_tokens}, Hk={ws.Hk}, Hv={ws.Hv}, S={ws.S}) does not fit "
                         f"T={T}, Hk={Hk}, Hv={Hv}, S={S}")
    C = 2 * Hk * S + Hv * S
    conv_silu_prefill(proj, conv_w, conv_state, ws.u, C, stream)
    qk_norm_gates, n_items = _qk_norm_gates_kernel(S, Hk, Hv)
    qk_norm_gates[_row_blocks(T * n_items, S), 32 * WARPS_ROW, stream](proj, ws.u, ws.qk16, ssm_a, dt_bias,
                                                                     ws.beta, ws.g, T, eps)
    launch_chunk_intra_mma(ws, T, stream)
    launch_chunk_state_f16(ws, state, y_out, T, stream, bv=state_bv)
    if normalize:
        gated_norm(proj, norm_w, y_out, T, Hk, eps, stream=stream)


def gated_norm(proj, norm_w, y, T: int, Hk: int, eps: float, stream=0) -> None:
    """y[:T] <- RMSNorm(y[:T] per head) * norm_w * silu(z) in place. proj: [>= T, P] float32 (z at columns
    [2 Hk S + Hv S, ...)), norm_w: [S] float32, y: [>= T, Hv*S] float32 raw o."""
    S = norm_w.shape[0]
    Hv = y.shape[1] // S
    _gated_norm_kernel(S, Hk, Hv)[_row_blocks(T * Hv, S), 32 * WARPS_ROW, stream](proj, norm_w, y, T, eps)


def _row_blocks(n_items: int, S: int) -> int:
    """Blocks of the row kernels for n_items rows of S elements."""
    per_block = 32 * WARPS_ROW // lanes_per_row(S)
    return (n_items + per_block - 1) // per_block
