"""GDN prefill (chunked form): the whole token mixer for T tokens, as a sequence of kernels on one stream.

Reference: ``gdn_mixer_ref`` in ref.py (chunked=True). Order, each kernel reading what the previous wrote:
  1. conv_silu_norm + conv_state_shift        u = silu(conv(proj[:, :C])): its q, k heads L2-normalised as
     (conv.py)                                 float16 (qk16), its v heads (v); conv state <- last K-1 inputs
  2. gates                                     beta, g [T, Hv]
  3. chunk_intra_mma (chunk_intra_mma.py)     G, W, U, P per (chunk, value head), tensor cores (3xTF32)
  4. chunk_state_f16 (chunk_state_f16.py)     raw o into y_out; state carried over all chunks, f16 tensor cores
  5. gated_norm                                y_out <- RMSNorm(o) * w * silu(z), in place (or, normalize=False,
                                               in the kernel making the out-projection's activation)
All intermediates live in a ``GdnPrefillWorkspace`` sized for the longest prompt; kernels receive the full
workspace arrays plus T and touch rows < T only. Callers that must never allocate pass ``ws``; without it
one workspace per (device, shape) is kept here and grown to the longest T seen (allocation then happens
only on a first or longer call, never during graph capture of decode, which does not use it).
"""
from functools import lru_cache

import numpy as np
from numba import float32

from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.gdn.chunk_intra_mma import launch_chunk_intra_mma
from ninfer_numba.kernels.gdn.chunk_state_f16 import launch_chunk_state_f16
from ninfer_numba.kernels.gdn.conv import conv_silu_norm_prefill
from ninfer_numba.kernels.gdn.device_math import gate_log_decay, gated_rms_apply, gated_rms_inverse, sigmoid_f32
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.reduce import row_sum_f32

WARPS_ROW = 4      # warps per block of the row kernels
GATES_TPB = 256    # threads per block of the gates kernel


def lanes_per_row(S: int) -> int:
    """Lanes sharing one head row in the row kernels: a power of two <= 32 leaving each lane >= 4 elements
    (S = 128: a full warp per row; the simulator's S = 16: 4 lanes, 8 rows per warp)."""
    n = 1
    while n * 2 <= 32 and n * 2 * 4 <= S:
        n *= 2
    return n


@lru_cache(maxsize=None)
def _gates_kernel(S: int, Hk: int, Hv: int):
    B0 = 2 * Hk * S + 2 * Hv * S       # proj column of beta_raw; alpha_raw follows at B0 + Hv

    @cached_jit()
    def gates(proj, ssm_a, dt_bias, beta, g, T):
        # proj: [T, P] f32, ssm_a, dt_bias: [Hv] f32 -> beta, g: [T, Hv] f32; one thread per (token, head)
        i = cuda.blockIdx.x * GATES_TPB + cuda.threadIdx.x
        if i < T * Hv:
            t = i // Hv
            j = i - t * Hv
            beta[t, j] = sigmoid_f32(proj[t, B0 + j])
            g[t, j] = gate_log_decay(proj[t, B0 + Hv + j], ssm_a[j], dt_bias[j])

    return gates


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
        # o and z are loaded together into registers before any use (re-reading o after the sums, and z
        # only then, left one load in flight at a time)
        r_o = cuda.local.array(NPL, float32)
        r_z = cuda.local.array(NPL, float32)
        acc = float32(0.0)
        if valid:
            for k in range(NPL):
                d = lane + LPR * k
                if d < S:
                    r_o[k] = y[t, base + d]
                    r_z[k] = proj[t, Z0 + base + d]
            for k in range(NPL):
                if lane + LPR * k < S:
                    acc += r_o[k] * r_o[k]
        acc = row_sum_f32(acc, LPR)          # every lane: shuffles need the whole warp
        if valid:
            inv_rms = gated_rms_inverse(acc, S, eps)
            for k in range(NPL):
                d = lane + LPR * k
                if d < S:
                    y[t, base + d] = gated_rms_apply(r_o[k], inv_rms, norm_w[d], r_z[k])

    return gated_norm


class GdnPrefillWorkspace:
    """Device scratch for gdn_prefill up to ``max_tokens`` tokens (reused by every GDN layer in turn).

    qk16: [T, 2·Hk·S] float16 the post-conv q, k heads L2-normalised, v: [T, Hv·S] the post-conv v heads,
    beta, g: [T, Hv], G: [Hv, T], U: [Hv, T, S] float32; W16: [Hv, T, S], P16: [Hv, T, BT] float16.
    9B at T = 8192: qk16 67, v 134, U 134, W16 67, P16 34 MB.
    """

    def __init__(self, max_tokens: int, Hk: int, Hv: int, S: int, stream=0) -> None:
        self.max_tokens, self.Hk, self.Hv, self.S = max_tokens, Hk, Hv, S
        T = max_tokens
        f32 = np.float32
        self.v = cuda.device_array((T, Hv * S), f32, stream=stream)
        self.beta = cuda.device_array((T, Hv), f32, stream=stream)
        self.g = cuda.device_array((T, Hv), f32, stream=stream)
        self.G = cuda.device_array((Hv, T), f32, stream=stream)
        self.qk16 = cuda.device_array((T, 2 * Hk * S), np.float16, stream=stream)
        self.W16 = cuda.device_array((Hv, T, S), np.float16, stream=stream)
        self.U = cuda.device_array((Hv, T, S), f32, stream=stream)
        self.P16 = cuda.device_array((Hv, T, BT), np.float16, stream=stream)
        # the kernels' word views, made once: a DeviceNDArray view or reshape costs ~10-30 us of Python, eight
        # of them per GDN layer per prefill call (per part in a packed forward)
        u32 = np.uint32
        self.qk16_words = self.qk16.view(u32).reshape(self.qk16.size // 2)    # [T·Hk·S] f16 pairs
        self.W16_pairs = self.W16.view(u32)                                     # [Hv, T, S/2] f16 pairs
        self.W16_words = self.W16_pairs.reshape(self.W16.size // 2)             # the same, flat
        self.P16_pairs = self.P16.view(u32)                                     # [Hv, T, BT/2] f16 pairs
        self.P16_words = self.P16_pairs.reshape(self.P16.size // 2)             # the same, flat
        self.U_flat = self.U.reshape(self.U.size)                               # [Hv·T·S] float32

    def arrays(self) -> tuple:
        return self.v, self.qk16, self.beta, self.g, self.G, self.W16, self.U, self.P16

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
    conv_silu_norm_prefill(proj, conv_w, conv_state, ws.qk16, ws.v, S, eps, stream)
    gates(proj, ssm_a, dt_bias, ws, T, stream)
    launch_chunk_intra_mma(ws, T, stream)
    launch_chunk_state_f16(ws, state, y_out, T, stream, bv=state_bv)
    if normalize:
        gated_norm(proj, norm_w, y_out, T, Hk, eps, stream=stream)


def gates(proj, ssm_a, dt_bias, ws: GdnPrefillWorkspace, T: int, stream=0) -> None:
    """ws.beta, ws.g [:T] <- the write strength and log-decay of every (token, value head) from proj's raw
    columns (ref.gdn_gates_ref)."""
    kernel = _gates_kernel(ws.S, ws.Hk, ws.Hv)
    kernel[(T * ws.Hv + GATES_TPB - 1) // GATES_TPB, GATES_TPB, stream](proj, ssm_a, dt_bias, ws.beta, ws.g, T)


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
