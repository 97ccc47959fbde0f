"""GDN prefill intra-chunk solve v4 on tensor cores (3xTF32 mma.sync): G, W, U and P of one chunk.

Computes the intra-chunk part of chunk_form.py with every product on the tensor cores at float32 accuracy
(mma_tf32.py): A = K Kᵀ and Q Kᵀ, then W = T (b e^G ⊙ K) and U = T (b ⊙ V) with T = (I + A)⁻¹ formed
explicitly by 16x16 blocks (tri_inverse.py).

Block per (chunk, value head), 4 warps. The products are triangular, so work is split by tiles, not rows:
in K Kᵀ / Q Kᵀ each warp takes 5 of the 20 (m16 row tile, n8 tile) pairs at or below the diagonal
(`kq_slot`); in W / U warps 0 and 2 take W, 1 and 3 take U, each on the row tiles {3, 0} or {2, 1}, which
is 10 k8 steps of T per output column for every warp. (v3 gave warp w row tile w everywhere: warp 3 did
four times warp 0's work, and T came from a 64-row substitution, one column per thread.)
Dynamic shared memory, float32 words, rows padded for conflict-free fragment reads (mma_tf32.py):
  s_k  [BT, S+4]    the chunk's k rows (A operand of K Kᵀ, B operand of both K Kᵀ and W)
  s_qv [BT, S+8]    q rows (A operand of Q Kᵀ), then v rows (B operand of U)
  s_a  [BT, BT+4]   A, strictly lower, only the part below the diagonal written (rows past the chunk's
                    end are 0: their b is 0)
  s_t  [BT, BT+4]   T = (I + A)⁻¹, lower with unit diagonal; the diagonal blocks zero above the diagonal,
                    the blocks above them never written nor read
  s_b, s_g, s_bg [BT]  b, cumulative G, b·e^G (rows past the end: b = 0, G = G_last so every exponent <= 0)
Steps (barriers between): 1. cp.async k, q rows; gates and G  2. K Kᵀ, Q Kᵀ -> A into s_a, P (zero above
the diagonal) out  3. cp.async v rows; T  4. W and U in batches of NB n8 tiles, k-steps up to the
diagonal block only.

Outputs (prefill workspace, chunk_form.py): G_out [Hv, T], W_out, U_out [Hv, T, S], P_out [Hv, T, BT]
(row i, columns 0..16·(i//16)+15 written; zero above the diagonal).
"""
import math
from functools import lru_cache

from numba import float32, types, uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.dynamic_smem import allow_dynamic_smem
from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.gdn.row_stage import make_row_stager
from ninfer_numba.kernels.gdn.tri_inverse import make_tri_inverse
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.mma_tf32 import make_a_split_ldmatrix, make_mma3_tiles, split_tf32
from ninfer_numba.kernels.ptx import i32_as_f32, ldmatrix_x4
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

N_WARPS = 4
TPB = 32 * N_WARPS
AP = BT + 4                      # row stride of s_a and s_t


@cuda.jit(device=True, inline=True)
def kq_slot(idx):
    """(row tile, n8 tile) of slot idx of the 20 pairs at or below the diagonal of K Kᵀ / Q Kᵀ, ordered so
    that warp w's slots 5w..5w+4 span at most two row tiles: row tile 3 (8), 0 (2), 2 (6), 1 (4)."""
    if idx < 8:
        return 3, idx
    if idx < 10:
        return 0, idx - 8
    if idx < 16:
        return 2, idx - 10
    return 1, idx - 16


def intra_smem_words(S: int) -> int:
    return BT * (S + 4) + BT * (S + 8) + 2 * BT * AP + 3 * BT


@lru_cache(maxsize=None)
def chunk_intra_mma_kernel(S: int, Hk: int, Hv: int):
    if Hv % Hk != 0 or S % 16 != 0:
        raise ValueError(f"need Hv % Hk == 0 and S % 16 == 0 (Hk={Hk}, Hv={Hv}, S={S})")
    KP = S + 4
    VP = S + 8
    OFF_QV = BT * KP
    OFF_A = OFF_QV + BT * VP
    OFF_T = OFF_A + BT * AP
    OFF_B = OFF_T + BT * AP
    OFF_G = OFF_B + BT
    OFF_BG = OFF_G + BT
    KS = S // 8                  # k8 steps over the head dimension
    NB = max(d for d in range(1, 9) if (S // 8) % d == 0)     # n8 tiles per batch of W or U
    NBATCH = S // (8 * NB)
    K0 = Hk * S                  # u column of key head 0
    V0 = 2 * Hk * S              # u column of value head 0
    ACC_KQ = 4 * 5               # accumulator words of a warp's 5 (row tile, n8 tile) slots of K Kᵀ / Q Kᵀ
    ACC_B = 4 * NB               # accumulator words of a batch of W or U on one row tile
    BFR = 4 * max(5, NB)
    f0 = float32(0.0)
    mma3_kq = make_mma3_tiles(5)
    mma3_batch = make_mma3_tiles(NB)
    tri_inverse = make_tri_inverse(AP, OFF_A, OFF_T)
    load_k = make_a_split_ldmatrix(KP)           # k and q rows
    load_t = make_a_split_ldmatrix(AP)           # T rows
    stage = make_row_stager(TPB, S // 4, BT)

    @cuda.jit(device=True, inline=True)
    def load_kt_pair(smem, w, s_a, s_b, ks, bfr):
        """bfr[4s : 4s+4] = split B fragments of k-step ks for slots s_a and s_b (k rows of their n8 tiles) by
        one ldmatrix.x4: lanes 0-15 address slot s_a's tile, 16-31 slot s_b's."""
        lane = cuda.threadIdx.x & 31
        _, nt = kq_slot(5 * w + (s_b if lane >= 16 else s_a))
        r0, r1, r2, r3 = ldmatrix_x4(smem, uint32((8 * nt + (lane & 7)) * KP + 8 * ks + 4 * ((lane >> 3) & 1)))
        bfr[4 * s_a], bfr[4 * s_a + 2] = split_tf32(i32_as_f32(r0))
        bfr[4 * s_a + 1], bfr[4 * s_a + 3] = split_tf32(i32_as_f32(r1))
        bfr[4 * s_b], bfr[4 * s_b + 2] = split_tf32(i32_as_f32(r2))
        bfr[4 * s_b + 1], bfr[4 * s_b + 3] = split_tf32(i32_as_f32(r3))

    @cuda.jit(device=True, inline=True)
    def kq_products(smem, acc_k, acc_q, bfr, w, gq, t, ra1, ra2, N1):
        """K Kᵀ and Q Kᵀ of the warp's 5 slots, the first N1 on the row tile at ra1, the rest at ra2."""
        for ks0 in range(0, KS, 2):                      # pairs of k8 steps: one basic block for ptxas
            for uu in range(2):
                ks = ks0 + uu
                for s2 in range(3):                      # B[t, g] = K[8nt + g, 8ks + t]: k rows, slots in pairs
                    load_kt_pair(smem, w, 2 * s2, min(2 * s2 + 1, 4), ks, bfr)
                kh0, kh1, kh2, kh3, kl0, kl1, kl2, kl3 = load_k(smem, uint32(ra1 + 8 * ks))
                qh0, qh1, qh2, qh3, ql0, ql1, ql2, ql3 = load_k(smem, uint32(OFF_QV + ra1 + 8 * ks))
                mma3_kq(acc_k, 0, 0, N1, kh0, kh1, kh2, kh3, kl0, kl1, kl2, kl3, bfr)
                mma3_kq(acc_q, 0, 0, N1, qh0, qh1, qh2, qh3, ql0, ql1, ql2, ql3, bfr)
                if N1 < 5:
                    kh0, kh1, kh2, kh3, kl0, kl1, kl2, kl3 = load_k(smem, uint32(ra2 + 8 * ks))
                    qh0, qh1, qh2, qh3, ql0, ql1, ql2, ql3 = load_k(smem, uint32(OFF_QV + ra2 + 8 * ks))
                    mma3_kq(acc_k, 0, N1, 5, kh0, kh1, kh2, kh3, kl0, kl1, kl2, kl3, bfr)
                    mma3_kq(acc_q, 0, N1, 5, qh0, qh1, qh2, qh3, ql0, ql1, ql2, ql3, bfr)

    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 2)}

    @cached_jit(**occupancy)
    def chunk_intra_mma(u, beta, g, G_out, W_out, U_out, P_out, T):
        # u: [T, C] f32, beta, g: [T, Hv] f32 -> G_out: [Hv, T], W_out, U_out: [Hv, T, S], P_out: [Hv, T, BT]
        smem = cuda.shared.array(0, types.float32, alignment=16)
        acc_k = cuda.local.array(ACC_KQ, float32)       # [slot, c0..c3] K Kᵀ
        acc_q = cuda.local.array(ACC_KQ, float32)       # [slot, c0..c3] Q Kᵀ
        acc_hi = cuda.local.array(ACC_B, float32)      # [n8 tile, c0..c3] W or U rows of tile r_hi
        acc_lo = cuda.local.array(ACC_B, float32)      # and of tile r_lo
        bfr = cuda.local.array(BFR, types.uint32)       # [slot or n8 tile, hi0, hi1, lo0, lo1] B fragments
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        gq = lane >> 2
        t = lane & 3
        t0 = cuda.blockIdx.x * BT
        j = cuda.blockIdx.y
        kh = j % Hk
        c = min(BT, T - t0)

        ncol = u.shape[1]
        stage(smem, 0, KP, u, t0 * ncol + K0 + kh * S, ncol, c, True)
        stage(smem, OFF_QV, KP, u, t0 * ncol + kh * S, ncol, c, True)
        ptx.cp_async_commit()
        if tid < BT:
            smem[uint32(OFF_B + tid)] = beta[uint32(t0 + tid), uint32(j)] if tid < c else f0
            # raw g until the scan below
            smem[uint32(OFF_BG + tid)] = g[uint32(t0 + tid), uint32(j)] if tid < c else f0
        cuda.syncthreads()
        if tid < BT:                                     # G_i = Σ_{m <= min(i, c-1)} g_m (broadcast reads)
            acc = f0
            for m in range(min(tid, c - 1) + 1):
                acc += smem[uint32(OFF_BG + m)]
        cuda.syncthreads()
        if tid < BT:
            smem[uint32(OFF_G + tid)] = acc
            smem[uint32(OFF_BG + tid)] = smem[uint32(OFF_B + tid)] * math.exp(acc)
            if tid < c:
                G_out[uint32(j), uint32(t0 + tid)] = acc
        ptx.cp_async_wait_all()
        cuda.syncthreads()

        # 2. K Kᵀ and Q Kᵀ on the 20 (row tile, n8 tile) pairs at or below the diagonal, 5 per warp
        for x in range(ACC_KQ):
            acc_k[x] = f0
            acc_q[x] = f0
        r1, _ = kq_slot(5 * w)                           # the warp's one or two row tiles
        r2, _ = kq_slot(5 * w + 4)
        n1 = 0                                           # its slots on row tile r1
        for s in range(5):
            r, _ = kq_slot(5 * w + s)
            if r == r1:
                n1 += 1
        ra1 = 16 * r1 * KP                               # A[0, 0] of row tile r1 in s_k / s_qv
        ra2 = 16 * r2 * KP
        if n1 == 5:                                      # N1 a constant in each copy: no branch per mma
            kq_products(smem, acc_k, acc_q, bfr, w, gq, t, ra1, ra2, 5)
        elif n1 == 3:
            kq_products(smem, acc_k, acc_q, bfr, w, gq, t, ra1, ra2, 3)
        else:
            kq_products(smem, acc_k, acc_q, bfr, w, gq, t, ra1, ra2, 1)
        for s in range(5):
            r, nt = kq_slot(5 * w + s)
            for e in range(4):
                i = 16 * r + gq + 8 * (e >> 1)
                jj = 8 * nt + 2 * t + (e & 1)
                if jj <= i:
                    decay = math.exp(smem[uint32(OFF_G + i)] - smem[uint32(OFF_G + jj)])          # exponent <= 0
                    pij = acc_q[4 * s + e] * decay
                    if jj < i:
                        smem[uint32(OFF_A + i * AP + jj)] = smem[uint32(OFF_B + i)] * acc_k[4 * s + e] * decay
                else:
                    pij = f0
                if i < c:
                    P_out[uint32(j), uint32(t0 + i), uint32(jj)] = pij
        cuda.syncthreads()                               # A complete; q rows read: s_qv is free for v

        # 3. v rows fly while T = (I + A)⁻¹ is formed by 16x16 blocks (tri_inverse.py)
        stage(smem, OFF_QV, VP, u, t0 * ncol + V0 + j * S, ncol, c, True)
        ptx.cp_async_commit()
        tri_inverse(smem)
        ptx.cp_async_wait_all()
        cuda.syncthreads()

        # 4. W = T (b e^G ⊙ K) (warps 0, 2), U = T (b ⊙ V) (warps 1, 3), each on row tiles 3 and 0 (warps
        # 0, 1) or 2 and 1 (warps 2, 3): 10 k8 steps of T per column for every warp; NB n8 tiles per batch
        r_hi = 3 - (w >> 1)
        r_lo = w >> 1
        is_w = (w & 1) == 0
        rt_hi = OFF_T + 16 * r_hi * AP                   # A[0, 0] of the T rows
        rt_lo = OFF_T + 16 * r_lo * AP
        for batch in range(NBATCH):
            col0 = batch * NB * 8                        # first column of the batch inside W or U
            for x in range(ACC_B):
                acc_hi[x] = f0
                acc_lo[x] = f0
            for ks0 in range(0, 2 * r_hi + 2, 2):             # pairs of k8 steps: one basic block for ptxas to schedule
                for uu in range(2):
                    ks = ks0 + uu
                    r0 = 8 * ks + t                          # B rows (chunk rows) of b0 and b1
                    r1 = r0 + 4
                    if is_w:
                        s0 = smem[uint32(OFF_BG + r0)]
                        s1 = smem[uint32(OFF_BG + r1)]
                        p0 = r0 * KP + col0 + gq
                        p1 = r1 * KP + col0 + gq
                    else:
                        s0 = smem[uint32(OFF_B + r0)]
                        s1 = smem[uint32(OFF_B + r1)]
                        p0 = OFF_QV + r0 * VP + col0 + gq
                        p1 = OFF_QV + r1 * VP + col0 + gq
                    for nt in range(NB):
                        bfr[4 * nt], bfr[4 * nt + 2] = split_tf32(s0 * smem[uint32(p0 + 8 * nt)])
                        bfr[4 * nt + 1], bfr[4 * nt + 3] = split_tf32(s1 * smem[uint32(p1 + 8 * nt)])
                    th0, th1, th2, th3, tl0, tl1, tl2, tl3 = load_t(smem, uint32(rt_hi + 8 * ks))
                    mma3_batch(acc_hi, 0, 0, NB, th0, th1, th2, th3, tl0, tl1, tl2, tl3, bfr)
                    if ks < 2 * r_lo + 2:
                        th0, th1, th2, th3, tl0, tl1, tl2, tl3 = load_t(smem, uint32(rt_lo + 8 * ks))
                        mma3_batch(acc_lo, 0, 0, NB, th0, th1, th2, th3, tl0, tl1, tl2, tl3, bfr)
            for nt in range(NB):
                for e in range(4):
                    d = col0 + 8 * nt + 2 * t + (e & 1)
                    i_hi = 16 * r_hi + gq + 8 * (e >> 1)
                    i_lo = 16 * r_lo + gq + 8 * (e >> 1)
                    if is_w:
                        if i_hi < c:
                            W_out[uint32(j), uint32(t0 + i_hi), uint32(d)] = acc_hi[4 * nt + e]
                        if i_lo < c:
                            W_out[uint32(j), uint32(t0 + i_lo), uint32(d)] = acc_lo[4 * nt + e]
                    else:
                        if i_hi < c:
                            U_out[uint32(j), uint32(t0 + i_hi), uint32(d)] = acc_hi[4 * nt + e]
                        if i_lo < c:
                            U_out[uint32(j), uint32(t0 + i_lo), uint32(d)] = acc_lo[4 * nt + e]

    return chunk_intra_mma


def launch_chunk_intra_mma(ws, T: int, stream=0) -> None:
    """chunk_intra_mma over the first T rows of workspace ``ws`` (chunk.py's GdnPrefillWorkspace)."""
    kernel = chunk_intra_mma_kernel(ws.S, ws.Hk, ws.Hv)
    args = (ws.u, ws.beta, ws.g, ws.G, ws.W, ws.U, ws.P, T)
    nbytes = 4 * intra_smem_words(ws.S)
    allow_dynamic_smem(kernel, args, nbytes)
    kernel[((T + BT - 1) // BT, ws.Hv), TPB, stream, nbytes](*args)
