"""GDN prefill state pass v2: the chunk's W, Q and K rows staged in shared memory, register-tiled outputs.

Same contract and arithmetic as ``chunk_state_kernel`` (chunk_kernels.py, v1), which it replaces in
gdn_prefill. v1 read W, Q and K from global memory inside its inner loops (one dependent global load per
FMA: latency-bound at ~1 TFLOP/s). Here each chunk step first copies the rows it needs into one shared
buffer with every thread issuing independent coalesced loads, then computes from shared memory with each
thread owning several outputs of one value column, so a state element loaded once serves all of them:

  stage W            s_x <- W[j, chunk]                         [c, S]
  V' = U - W h       thread: rows g + G·r, column col           -> s_vn [BT, BV]
  stage Q            s_x <- q rows of u
  O = e^G (Q h) + P V'  (P read from global, broadcast per row)  -> o_out
  stage K̃            s_x <- k rows of u times e^(G_last - G_i)
  h <- e^G_last h + K̃^T V'   thread: rows d = g + G·r, column col (each state element owned by one thread)

Shared memory: s_x [BT, S+1] (padded: the two row groups of a warp read different banks), s_h [S, BV],
s_vn [BT, BV], two [BT] vectors: 45.8 KB at S = 128, under the 48 KB static limit.
Grid: (S / BV, Hv) blocks of NT threads, NT = BV·G with G row groups (G = 16 at S >= 64, else 4).
"""
import math
from functools import lru_cache

from numba import float32

from ninfer_numba.kernels.gdn.chunk_kernels import BT
from ninfer_numba.kernels.numba_env import cuda

BV_STAGED = 16     # value columns per block


def staged_tiling(S: int) -> tuple[int, int]:
    """(BV, threads per block) of the staged state pass."""
    G = 16 if S >= 64 else 4
    if S % BV_STAGED != 0 or S % G != 0:
        raise ValueError(f"S={S} must be a multiple of {BV_STAGED} and of {G}")
    return BV_STAGED, BV_STAGED * G


@lru_cache(maxsize=None)
def chunk_state_staged_kernel(S: int, Hk: int, Hv: int):
    BV, NT = staged_tiling(S)
    G = NT // BV                   # row groups
    RV = BT // G                   # chunk rows per thread (V', O)
    RH = S // G                    # state rows per thread (h update)
    SP = S + 1
    K0 = Hk * S
    SCALE = 1.0 / math.sqrt(S)

    @cuda.jit
    def chunk_state_staged(u, G_cum, W, U, P, state, o_out, T):
        # u: [T, C], G_cum: [Hv, T], W, U: [Hv, T, S], P: [Hv, T, BT], state: [Hv, S, S] (in/out),
        # o_out: [T, Hv*S] raw (un-normalised) output
        tid = cuda.threadIdx.x
        col = tid % BV
        grp = tid // BV
        j = cuda.blockIdx.y
        kh = j % Hk
        v0 = cuda.blockIdx.x * BV
        s_x = cuda.shared.array((BT, SP), float32)     # the staged rows: W, then Q, then K̃
        s_h = cuda.shared.array((S, BV), float32)      # this block's columns of the running state
        s_vn = cuda.shared.array((BT, BV), float32)    # V' of the current chunk
        s_eg = cuda.shared.array(BT, float32)          # e^(G_i)
        s_ek = cuda.shared.array(BT, float32)          # e^(G_last - G_i)
        acc = cuda.local.array(RH, float32)            # RH >= RV is not assumed: sized for the larger use
        acc2 = cuda.local.array(RV, float32)
        for p in range(tid, S * BV, NT):
            s_h[p // BV, p % BV] = state[j, p // BV, v0 + p % BV]
        for t0 in range(0, T, BT):
            c = min(BT, T - t0)
            g_last = G_cum[j, t0 + c - 1]
            for i in range(tid, c, NT):
                gi = G_cum[j, t0 + i]
                s_eg[i] = float32(math.exp(gi))
                s_ek[i] = float32(math.exp(g_last - gi))
            for p in range(tid, c * S, NT):
                s_x[p // S, p % S] = W[j, t0 + p // S, p % S]
            cuda.syncthreads()
            # V' = U - W h
            for r in range(RV):
                acc2[r] = float32(0.0)
            for d in range(S):
                hd = s_h[d, col]
                for r in range(RV):
                    acc2[r] += s_x[grp + G * r, d] * hd
            for r in range(RV):
                i = grp + G * r
                if i < c:
                    s_vn[i, col] = U[j, t0 + i, v0 + col] - acc2[r]
            cuda.syncthreads()
            for p in range(tid, c * S, NT):
                s_x[p // S, p % S] = u[t0 + p // S, kh * S + p % S]
            cuda.syncthreads()
            # O = e^G (Q h) + P V'
            for r in range(RV):
                acc2[r] = float32(0.0)
            for d in range(S):
                hd = s_h[d, col]
                for r in range(RV):
                    acc2[r] += s_x[grp + G * r, d] * hd
            for r in range(RV):
                i = grp + G * r
                if i < c:
                    pv = float32(0.0)
                    for jj in range(i + 1):
                        pv += P[j, t0 + i, jj] * s_vn[jj, col]
                    o_out[t0 + i, j * S + v0 + col] = (s_eg[i] * acc2[r] + pv) * float32(SCALE)
            cuda.syncthreads()
            for p in range(tid, c * S, NT):
                i = p // S
                s_x[i, p % S] = u[t0 + i, K0 + kh * S + p % S] * s_ek[i]
            cuda.syncthreads()
            # h <- e^(G_last) h + K̃^T V'
            e_last = float32(math.exp(g_last))
            for r in range(RH):
                acc[r] = e_last * s_h[grp + G * r, col]
            for i in range(c):
                vn = s_vn[i, col]
                for r in range(RH):
                    acc[r] += s_x[i, grp + G * r] * vn
            for r in range(RH):
                s_h[grp + G * r, col] = acc[r]
            cuda.syncthreads()
        for p in range(tid, S * BV, NT):
            state[j, p // BV, v0 + p % BV] = s_h[p // BV, p % BV]

    return chunk_state_staged
