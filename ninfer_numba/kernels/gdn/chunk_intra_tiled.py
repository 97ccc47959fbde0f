"""GDN prefill intra-chunk solve v2: 4 x 4 register tiles for the A and P products, unsigned index walks.

Computes the intra-chunk solve of chunk_form.py. It replaced v1 (benchmarks/NOTES.md has both measured). v1
computed each (i, j) pair of A = K K^T and P = Q K^T by itself, one q element from global memory per FMA pair,
and indexed shared and local arrays with numba's signed indices (~20 instructions per FMA in the SASS,
negative-index handling included). Here a thread owns a 4 x 4 tile of pairs: per key element it loads 4 q
values and 8 k values and does 32 FMAs, walking flat arrays with unsigned offsets.

Per (chunk, value head) block of NT = 2S threads:
  s_k [BT, S+1]   the chunk's k rows (flat, padded)          s_A  packed strict lower triangle of A
  1. stage k, beta, g; thread 0 scans the cumulative decay G
  2. A, P over the 136 lower-triangular 4 x 4 tiles of the 64 x 64 pair grid: P -> P_out, A -> s_A
  3. (I + A) X = RHS by forward substitution, one column of W (S) or U (S) per thread
"""
import math
from functools import lru_cache

from numba import float32, uint32

from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import cuda

TL = 4                           # tile edge of the A / P products


@lru_cache(maxsize=None)
def chunk_intra_tiled_kernel(S: int, Hk: int, Hv: int):
    if Hv % Hk != 0 or S % 16 != 0:
        raise ValueError(f"need Hv % Hk == 0 and S % 16 == 0 (Hk={Hk}, Hv={Hv}, S={S})")
    NT = 2 * S                     # one thread per right-hand-side column: S of W, then S of U
    SP = S + 1                     # padded row of s_k
    NX = BT * SP
    NA = BT * (BT - 1) // 2        # packed strict lower triangle of A: row i starts at i*(i-1)/2
    NTI = BT // TL
    TT = TL * TL                   # pairs per tile (array sizes must be plain constants)
    N_TILES = NTI * (NTI + 1) // 2
    K0 = Hk * S                    # u column of key head 0
    V0 = 2 * Hk * S                # u column of value head 0

    @cached_jit()
    def chunk_intra_tiled(u, beta, g, G_out, W_out, U_out, P_out, T):
        # u: [T, C] f32, beta, g: [T, Hv] f32 -> G_out: [Hv, T], W_out, U_out: [Hv, T, S], P_out: [Hv, T, BT]
        tid = cuda.threadIdx.x
        t0 = cuda.blockIdx.x * BT
        j = cuda.blockIdx.y
        kh = j % Hk
        c = min(BT, T - t0)
        s_k = cuda.shared.array(NX, float32)
        s_A = cuda.shared.array(NA, float32)
        s_G = cuda.shared.array(BT, float32)
        s_b = cuda.shared.array(BT, float32)
        for p in range(tid, BT * S, NT):               # rows past the chunk's end are zero: tiles read them
            i = p // S
            s_k[i * SP + p % S] = u[t0 + i, K0 + kh * S + p % S] if i < c else float32(0.0)
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

        # A (strictly lower) and P (lower incl. diagonal), one 4 x 4 tile of (i, jj) per thread
        acc_k = cuda.local.array(TT, float32)
        acc_q = cuda.local.array(TT, float32)
        q_a = cuda.local.array(TL, float32)
        k_a = cuda.local.array(TL, float32)
        q_row = cuda.local.array(TL, uint32)
        for tile in range(tid, N_TILES, NT):
            ti = int((math.sqrt(8.0 * tile + 1.0) - 1.0) * 0.5)    # row of the triangular tile index
            while (ti + 1) * (ti + 2) // 2 <= tile:
                ti += 1
            while ti * (ti + 1) // 2 > tile:
                ti -= 1
            i0 = ti * TL
            j0 = (tile - ti * (ti + 1) // 2) * TL
            if i0 >= c:
                continue
            for x in range(TT):
                acc_k[x] = float32(0.0)
                acc_q[x] = float32(0.0)
            for a in range(TL):                        # rows past the chunk's end read row c-1: never stored
                q_row[a] = uint32(t0 + min(i0 + a, c - 1))
            qc = uint32(kh * S)
            xi = uint32(i0 * SP)
            xj = uint32(j0 * SP)
            for d in range(S):
                for a in range(TL):
                    q_a[a] = u[q_row[a], qc]
                    k_a[a] = s_k[xi + uint32(a * SP)]
                for b in range(TL):
                    kb = s_k[xj + uint32(b * SP)]
                    for a in range(TL):
                        acc_k[a * TL + b] += k_a[a] * kb
                        acc_q[a * TL + b] += q_a[a] * kb
                qc += uint32(1)
                xi += uint32(1)
                xj += uint32(1)
            for a in range(TL):
                i = i0 + a
                for b in range(TL):
                    jj = j0 + b
                    if i < c and jj <= i:
                        decay = float32(math.exp(s_G[i] - s_G[jj]))   # exponent <= 0
                        P_out[j, t0 + i, jj] = acc_q[a * TL + b] * decay
                        if jj < i:
                            s_A[i * (i - 1) // 2 + jj] = s_b[i] * acc_k[a * TL + b] * decay
        cuda.syncthreads()

        # forward substitution (I + A) X = RHS, one column per thread, the column in local memory
        r_x = cuda.local.array(BT, float32)
        d = tid % S
        is_w = tid < S
        for i in range(c):
            if is_w:
                s = s_b[i] * float32(math.exp(s_G[i])) * s_k[i * SP + d]
            else:
                s = s_b[i] * u[t0 + i, V0 + j * S + d]
            ap = uint32(i * (i - 1) // 2)
            xp = uint32(0)
            for jj in range(i):
                s -= s_A[ap] * r_x[xp]
                ap += uint32(1)
                xp += uint32(1)
            r_x[uint32(i)] = s
            if is_w:
                W_out[j, t0 + i, d] = s
            else:
                U_out[j, t0 + i, d] = s

    return chunk_intra_tiled
