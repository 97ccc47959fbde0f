"""Chunked (chunk BT = 64) gated delta rule for prefill: the intra-chunk solve and the serial state pass.

Reference: ``gdn_chunked_ref`` in ref.py; README.md derives the form. Per value head j and chunk of c <= BT
tokens, with G the in-chunk cumulative log-decay and h the state at the chunk start:
  A = strict_tril(b_i k_i.k_j e^(G_i-G_j)),  (I + A) W = b e^G K,  (I + A) U = b V        (intra)
  P = tril(q_i.k_j e^(G_i-G_j))                                                              (intra)
  V' = U - W h,  O = [e^G (Q h) + P V'] / sqrt(S),  h <- e^(G_last) h + (K e^(G_last-G))^T V'  (state pass)

``chunk_intra`` needs no state, so it runs with one block per (chunk, value head): T/64 x Hv blocks.
``chunk_state`` is serial over chunks; value columns of h are independent, so it runs one block per
(value tile, value head) and keeps its S x BV slice of h in shared memory for the whole sequence.
Inside it, a warp covers 32 consecutive (row, column) outputs, so W, Q and P rows are broadcast loads
and the shared tiles are read without bank conflicts.

Scratch layouts (prefill workspace): q, k, v are read from u [T, C] (q, k already L2-normalised),
beta, g: [T, Hv]; written by intra: G [Hv, T], W, U: [Hv, T, S], P: [Hv, T, BT] (row t holds the
chunk-local row, columns > the diagonal are never read).
"""
import math
from functools import lru_cache

from numba import float32

from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda

BT = 64            # chunk length


@lru_cache(maxsize=None)
def chunk_intra_kernel(S: int, Hk: int, Hv: int):
    if Hv % Hk != 0 or S % 16 != 0:
        raise ValueError(f"need Hv % Hk == 0 and S % 16 == 0 (Hk={Hk}, Hv={Hv}, S={S})")
    NT = 2 * S                     # one thread per right-hand-side column: S of W, then S of U
    SP = S + 1                     # padded row: a warp reading column d of 32 rows hits 32 banks
    NA = BT * (BT - 1) // 2        # packed strict lower triangle of A: row i starts at i*(i-1)/2
    K0 = Hk * S                    # u column of key head 0
    V0 = 2 * Hk * S                # u column of value head 0

    @cached_jit()
    def chunk_intra(u, beta, g, G_out, W_out, U_out, P_out, T):
        # u: [T, C] f32, beta, g: [T, Hv] f32 -> G_out: [Hv, T], W_out, U_out: [Hv, T, S], P_out: [Hv, T, BT]
        tid = cuda.threadIdx.x
        t0 = cuda.blockIdx.x * BT
        j = cuda.blockIdx.y
        kh = j % Hk
        c = min(BT, T - t0)
        s_k = cuda.shared.array((BT, SP), float32)
        s_A = cuda.shared.array(NA, float32)
        s_G = cuda.shared.array(BT, float32)
        s_b = cuda.shared.array(BT, float32)
        for p in range(tid, c * S, NT):
            i = p // S
            d = p % S
            s_k[i, d] = u[t0 + i, K0 + kh * S + d]
        for i in range(tid, c, NT):
            s_b[i] = beta[t0 + i, j]
            s_G[i] = g[t0 + i, j]
        cuda.syncthreads()
        if tid == 0:                                   # 64-step scan: cheaper than a barrier ladder
            acc = float32(0.0)
            for i in range(c):
                acc += s_G[i]
                s_G[i] = acc
                G_out[j, t0 + i] = acc
        cuda.syncthreads()

        # A (strictly lower) and P (lower incl. diagonal); a warp shares row i, so q_i / k_i broadcast
        for p in range(tid, BT * BT, NT):
            i = p // BT
            jj = p % BT
            if i < c and jj <= i:
                dkk = float32(0.0)
                dqk = float32(0.0)
                for d in range(S):
                    kj = s_k[jj, d]
                    dkk += s_k[i, d] * kj
                    dqk += u[t0 + i, kh * S + d] * kj
                decay = float32(math.exp(s_G[i] - s_G[jj]))   # exponent <= 0
                P_out[j, t0 + i, jj] = dqk * decay
                if jj < i:
                    s_A[i * (i - 1) // 2 + jj] = s_b[i] * dkk * decay
        cuda.syncthreads()

        # forward substitution (I + A) X = RHS, one column per thread, the column in local memory
        r_x = cuda.local.array(BT, float32)
        d = tid % S
        is_w = tid < S
        for i in range(c):
            if is_w:
                s = s_b[i] * float32(math.exp(s_G[i])) * s_k[i, d]
            else:
                s = s_b[i] * u[t0 + i, V0 + j * S + d]
            row = i * (i - 1) // 2
            for jj in range(i):
                s -= s_A[row + jj] * r_x[jj]
            r_x[i] = s
            if is_w:
                W_out[j, t0 + i, d] = s
            else:
                U_out[j, t0 + i, d] = s

    return chunk_intra


def state_tiling(S: int, BV: int = 16) -> tuple[int, int]:
    """(BV value columns per block, threads per block) of the state pass.

    The pass is serial over chunks and latency-bound, so more warps per SM matter more than reuse:
    BV = 16 gives S/16 x Hv blocks (256 for 9B, 384 for 27B) of up to 256 threads.
    """
    if S % BV != 0:
        raise ValueError(f"S={S} is not a multiple of BV={BV}")
    return BV, min(256, S * BV // 4)


@lru_cache(maxsize=None)
def chunk_state_kernel(S: int, Hk: int, Hv: int, BV: int = 16):
    BV, NT = state_tiling(S, BV)
    K0 = Hk * S
    SCALE = 1.0 / math.sqrt(S)

    @cached_jit()
    def chunk_state(u, G, W, U, P, state, o_out, T):
        # u: [T, C], G: [Hv, T], W, U: [Hv, T, S], P: [Hv, T, BT], state: [Hv, S, S] (in/out),
        # o_out: [T, Hv*S] raw (un-normalised) output
        tid = cuda.threadIdx.x
        vt = cuda.blockIdx.x
        j = cuda.blockIdx.y
        kh = j % Hk
        v0 = vt * BV
        s_h = cuda.shared.array((S, BV), float32)      # this block's columns of the running state
        s_vn = cuda.shared.array((BT, BV), float32)    # V' of the current chunk
        s_eg = cuda.shared.array(BT, float32)          # e^(G_i)
        s_ek = cuda.shared.array(BT, float32)          # e^(G_last - G_i)
        for p in range(tid, S * BV, NT):
            s_h[p // BV, p % BV] = state[j, p // BV, v0 + p % BV]
        for t0 in range(0, T, BT):
            c = min(BT, T - t0)
            g_last = G[j, t0 + c - 1]
            for i in range(tid, c, NT):
                gi = G[j, t0 + i]
                s_eg[i] = float32(math.exp(gi))
                s_ek[i] = float32(math.exp(g_last - gi))
            cuda.syncthreads()
            # V' = U - W h   (warp = 32 columns of one row: W row broadcast, s_h conflict-free)
            for p in range(tid, c * BV, NT):
                i = p // BV
                col = p % BV
                acc = U[j, t0 + i, v0 + col]
                for d in range(S):
                    acc -= W[j, t0 + i, d] * s_h[d, col]
                s_vn[i, col] = acc
            cuda.syncthreads()
            # O = e^G (Q h) + P V'
            for p in range(tid, c * BV, NT):
                i = p // BV
                col = p % BV
                qh = float32(0.0)
                for d in range(S):
                    qh += u[t0 + i, kh * S + d] * s_h[d, col]
                pv = float32(0.0)
                for jj in range(i + 1):
                    pv += P[j, t0 + i, jj] * s_vn[jj, col]
                o_out[t0 + i, j * S + v0 + col] = (s_eg[i] * qh + pv) * float32(SCALE)
            cuda.syncthreads()
            # h <- e^(G_last) h + (K e^(G_last - G))^T V'   (each (d, col) owned by one thread)
            e_last = float32(math.exp(g_last))
            for p in range(tid, S * BV, NT):
                d = p // BV
                col = p % BV
                acc = e_last * s_h[d, col]
                for i in range(c):
                    acc += u[t0 + i, K0 + kh * S + d] * s_ek[i] * s_vn[i, col]
                s_h[d, col] = acc
            cuda.syncthreads()
        for p in range(tid, S * BV, NT):
            state[j, p // BV, v0 + p % BV] = s_h[p // BV, p % BV]

    return chunk_state
