"""GDN prefill state pass v2: the chunk's W, Q and K rows staged in shared memory, register-tiled outputs.

Computes the state pass of chunk_form.py. It replaced v1 (benchmarks/NOTES.md has both measured). v1 read W, Q
and K from global memory inside its inner loops (one dependent global load per FMA: latency-bound at ~1
TFLOP/s). Here each chunk step first copies the rows it needs into one shared buffer with every thread issuing
independent coalesced loads, then computes from shared memory with each thread owning several outputs of one
value column, so a state element loaded once serves all of them:

  stage W            s_x <- W[j, chunk]                         [c, S]
  V' = U - W h       thread: rows g + G·r, column col           -> s_vn [BT, BV]
  stage Q            s_x <- q rows of u
  O = e^G (Q h) + P V'  (s_x <- P rows once Q h is in registers) -> o_out
  stage K̃            s_x <- k rows of u times e^(G_last - G_i)
  h <- e^G_last h + K̃^T V'   thread: rows d = g + G·r, column col (each state element owned by one thread)

Shared memory: s_x [BT, max(S, BT)+1] (padded: the two row groups of a warp read different banks), s_h [S, BV],
s_vn [BT, BV], two [BT] vectors: 45.8 KB at S = 128, under the 48 KB static limit. The three are flat
arrays walked by unsigned running offsets in the inner loops: numba's signed 2-D indexing costs ~20 integer
instructions per load there (negative-index handling), the unsigned walk ~3 per FMA (compiled SASS).
Grid: (S / BV, Hv) blocks of NT threads, NT = BV·G with G row groups (G = 16 at S >= 64, else 4).
"""
import math
from functools import lru_cache

from numba import float32, uint32

from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

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
    SP = max(S, BT) + 1                        # s_x row stride: a row holds S values of W/Q/K or BT of P
    NX, NH, NV = BT * SP, S * BV, BT * BV      # flat sizes of s_x, s_h, s_vn
    GSP = G * SP                               # s_x offset between a thread's consecutive rows
    K0 = Hk * S
    SCALE = 1.0 / math.sqrt(S)

    @cuda.jit(device=True, inline=True)
    def _rows_times_h(s_x, s_h, out, col, grp):
        """out[r] = Σ_d s_x[grp + G·r, d] · s_h[d, col] for the thread's RV rows (flat, unsigned walk)."""
        for r in range(RV):
            out[r] = float32(0.0)
        hp = uint32(col)
        xp = uint32(grp * SP)
        for d in range(S):
            hd = s_h[hp]
            for r in range(RV):
                out[r] += s_x[xp + uint32(GSP * r)] * hd
            hp += uint32(BV)
            xp += uint32(1)

    # two blocks per SM (<= 128 registers): 256 blocks at 9B then run in one wave on 132 SMs
    occupancy = {} if SIMULATOR else {"launch_bounds": (NT, 2)}

    @cached_jit(**occupancy)
    def chunk_state_staged(u, G_cum, W, U, P, state, o_out, T):
        # u: [T, C], G_cum: [Hv, T], W, U: [Hv, T, S], P: [Hv, T, BT], state: [Hv, S, S] (in/out),
        # o_out: [T, Hv*S] raw (un-normalised) output
        tid = cuda.threadIdx.x
        col = tid % BV
        grp = tid // BV
        j = cuda.blockIdx.y
        kh = j % Hk
        v0 = cuda.blockIdx.x * BV
        s_x = cuda.shared.array(NX, float32)       # [BT, SP] the staged rows: W, then Q, then K̃
        s_h = cuda.shared.array(NH, float32)       # [S, BV] this block's columns of the running state
        s_vn = cuda.shared.array(NV, float32)      # [BT, BV] V' of the current chunk
        s_eg = cuda.shared.array(BT, float32)      # e^(G_i)
        s_ek = cuda.shared.array(BT, float32)      # e^(G_last - G_i)
        acc = cuda.local.array(RH, float32)
        acc2 = cuda.local.array(RV, float32)
        for p in range(tid, S * BV, NT):
            s_h[p] = state[j, p // BV, v0 + p % BV]
        for t0 in range(0, T, BT):
            c = min(BT, T - t0)
            g_last = G_cum[j, t0 + c - 1]
            for i in range(tid, c, NT):
                gi = G_cum[j, t0 + i]
                s_eg[i] = float32(math.exp(gi))
                s_ek[i] = float32(math.exp(g_last - gi))
            for p in range(tid, c * S, NT):
                s_x[(p // S) * SP + p % S] = W[j, t0 + p // S, p % S]
            cuda.syncthreads()
            # V' = U - W h
            _rows_times_h(s_x, s_h, acc2, col, grp)
            for r in range(RV):
                i = grp + G * r
                if i < c:
                    s_vn[i * BV + col] = U[j, t0 + i, v0 + col] - acc2[r]
            cuda.syncthreads()
            for p in range(tid, c * S, NT):
                s_x[(p // S) * SP + p % S] = u[t0 + p // S, kh * S + p % S]
            cuda.syncthreads()
            # O = e^G (Q h) + P V'; P's rows replace Q's in s_x once Q h is in registers
            _rows_times_h(s_x, s_h, acc2, col, grp)
            cuda.syncthreads()
            for p in range(tid, c * BT, NT):
                s_x[(p // BT) * SP + p % BT] = P[j, t0 + p // BT, p % BT]
            cuda.syncthreads()
            for r in range(RV):
                i = grp + G * r
                if i < c:
                    pv = float32(0.0)
                    xp = uint32(i * SP)
                    vp = uint32(col)
                    for jj in range(i + 1):
                        pv += s_x[xp] * s_vn[vp]
                        xp += uint32(1)
                        vp += uint32(BV)
                    o_out[t0 + i, j * S + v0 + col] = (s_eg[i] * acc2[r] + pv) * float32(SCALE)
            cuda.syncthreads()
            for p in range(tid, c * S, NT):
                i = p // S
                s_x[i * SP + p % S] = u[t0 + i, K0 + kh * S + p % S] * s_ek[i]
            cuda.syncthreads()
            # h <- e^(G_last) h + K̃^T V'
            e_last = float32(math.exp(g_last))
            for r in range(RH):
                acc[r] = e_last * s_h[(grp + G * r) * BV + col]
            vp = uint32(col)
            xp = uint32(grp)
            for i in range(c):
                vn = s_vn[vp]
                for r in range(RH):
                    acc[r] += s_x[xp + uint32(G * r)] * vn
                vp += uint32(BV)
                xp += uint32(SP)
            for r in range(RH):
                s_h[(grp + G * r) * BV + col] = acc[r]
            cuda.syncthreads()
        for p in range(tid, S * BV, NT):
            state[j, p // BV, v0 + p % BV] = s_h[p]

    return chunk_state_staged
