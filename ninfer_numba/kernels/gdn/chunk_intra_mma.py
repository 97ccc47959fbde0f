"""GDN prefill intra-chunk solve v3 on tensor cores (3xTF32 mma.sync): G, W, U and P of one chunk.

Computes the intra-chunk part of chunk_form.py with every product on the tensor cores at float32 accuracy
(mma_tf32.py): A = K Kᵀ and Q Kᵀ, then W = T (b e^G ⊙ K) and U = T (b ⊙ V) with T = (I + A)⁻¹ formed
explicitly by forward substitution (v2 solved for the 2S right-hand sides directly: 2S dependent chains of
up to 64 steps per block, the bulk of its 1.46 ms at 9B / 8K).

Block per (chunk, value head), 4 warps; warp w owns chunk rows 16w..16w+15 (one m16 tile) in every product.
Dynamic shared memory, float32 words, rows padded for conflict-free fragment reads (mma_tf32.py):
  s_k  [BT, S+4]    the chunk's k rows (A operand of K Kᵀ, B operand of both K Kᵀ and W)
  s_qv [BT, S+8]    q rows (A operand of Q Kᵀ), then v rows (B operand of U)
  s_a  [BT, BT+4]   A, strictly lower (rows past the chunk's end are 0: their b is 0)
  s_t  [BT, BT+4]   T = (I + A)⁻¹, lower with unit diagonal, zero above
  s_b, s_g, s_bg [BT]  b, cumulative G, b·e^G (rows past the end: b = 0, G = G_last so every exponent <= 0)
Steps (barriers between): 1. cp.async k, q rows; gates and G  2. K Kᵀ, Q Kᵀ on the tiles at or below the
diagonal (warp w: n8 tiles 0..2w+1) -> A into s_a, P (zero above the diagonal) out  3. cp.async v rows;
T by forward substitution, one column per thread of warps 0-1, warps 2-3 zero the upper triangle
4. W and U in batches of NB n8 tiles, k-steps 0..2w+1 only (T is zero beyond the diagonal).

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
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.mma_tf32 import make_a_split_loader, make_mma3_tiles, split_tf32
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

N_WARPS = 4
TPB = 32 * N_WARPS
AP = BT + 4                      # row stride of s_a and s_t


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
    NB = min(8, S // 8)          # n8 tiles per batch of W / U (a batch never straddles W and U)
    NBATCH = 2 * S // (8 * NB)
    K0 = Hk * S                  # u column of key head 0
    V0 = 2 * Hk * S              # u column of value head 0
    ACC = 4 * (BT // 8)          # accumulator words of one product row tile (8 n8 tiles)
    f0 = float32(0.0)
    mma3_tiles = make_mma3_tiles(BT // 8)
    mma3_batch = make_mma3_tiles(NB)
    load_k = make_a_split_loader(KP)             # k and q rows
    load_t = make_a_split_loader(AP)             # T rows
    stage = make_row_stager(TPB, S // 4, BT)

    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 2)}

    @cached_jit(**occupancy)
    def chunk_intra_mma(u, beta, g, G_out, W_out, U_out, P_out, T):
        # u: [T, C] f32, beta, g: [T, Hv] f32 -> G_out: [Hv, T], W_out, U_out: [Hv, T, S], P_out: [Hv, T, BT]
        smem = cuda.shared.array(0, types.float32, alignment=16)
        acc_k = cuda.local.array(ACC, float32)          # [n8 tile, c0..c3] K Kᵀ, then W / U batches
        acc_q = cuda.local.array(ACC, float32)          # [n8 tile, c0..c3] Q Kᵀ
        bfr = cuda.local.array(ACC, types.uint32)       # [n8 tile, hi0, hi1, lo0, lo1] B fragments
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
            smem[uint32(OFF_BG + tid)] = g[uint32(t0 + tid), uint32(j)] if tid < c else f0      # raw g until the scan below
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

        # 2. K Kᵀ and Q Kᵀ: warp w rows 16w.., n8 tiles 0..2w+1 (the rest is above the diagonal)
        for x in range(ACC):
            acc_k[x] = f0
            acc_q[x] = f0
        ra = (16 * w + gq) * KP + t                      # A[g, t] of the warp's tile in s_k / s_qv
        rb = gq * KP + t                                 # B[t, g] = K[8nt + g, 8ks + t]
        for ks in range(KS):
            kh0, kh1, kh2, kh3, kl0, kl1, kl2, kl3 = load_k(smem, uint32(ra + 8 * ks))
            qh0, qh1, qh2, qh3, ql0, ql1, ql2, ql3 = load_k(smem, uint32(OFF_QV + ra + 8 * ks))
            for nt in range(BT // 8):
                if nt <= 2 * w + 1:
                    bfr[4 * nt], bfr[4 * nt + 2] = split_tf32(smem[uint32(rb + 8 * nt * KP + 8 * ks)])
                    bfr[4 * nt + 1], bfr[4 * nt + 3] = split_tf32(smem[uint32(rb + 8 * nt * KP + 8 * ks + 4)])
            mma3_tiles(acc_k, 0, 2 * w + 2, kh0, kh1, kh2, kh3, kl0, kl1, kl2, kl3, bfr)
            mma3_tiles(acc_q, 0, 2 * w + 2, qh0, qh1, qh2, qh3, ql0, ql1, ql2, ql3, bfr)
        for nt in range(BT // 8):
            if nt <= 2 * w + 1:
                for e in range(4):
                    i = 16 * w + gq + 8 * (e >> 1)
                    jj = 8 * nt + 2 * t + (e & 1)
                    if jj <= i:
                        decay = math.exp(smem[uint32(OFF_G + i)] - smem[uint32(OFF_G + jj)])          # exponent <= 0
                        pij = acc_q[4 * nt + e] * decay
                        if jj < i:
                            smem[uint32(OFF_A + i * AP + jj)] = smem[uint32(OFF_B + i)] * acc_k[4 * nt + e] * decay
                    else:
                        pij = f0
                    if i < c:
                        P_out[uint32(j), uint32(t0 + i), uint32(jj)] = pij
        cuda.syncthreads()                               # q rows read: s_qv is free for v

        # 3. v rows fly while T = (I + A)⁻¹ is formed: column tid of T by forward substitution
        stage(smem, OFF_QV, VP, u, t0 * ncol + V0 + j * S, ncol, c, True)
        ptx.cp_async_commit()
        if tid < BT:
            col = tid
            smem[uint32(OFF_T + col * AP + col)] = float32(1.0)
            for i in range(col + 1, BT):                 # T[i, col] = -Σ_{col <= m < i} A[i, m] T[m, col]
                ap = uint32(OFF_A + i * AP + col)        # walks A[i, m] along the row
                tp = uint32(OFF_T + col * AP + col)      # walks T[m, col] down the column
                s0 = f0
                s1 = f0
                for _ in range((i - col) >> 1):
                    s0 += smem[ap] * smem[tp]
                    s1 += smem[ap + uint32(1)] * smem[tp + uint32(AP)]
                    ap += uint32(2)
                    tp += uint32(2 * AP)
                if (i - col) & 1:
                    s0 += smem[ap] * smem[tp]
                smem[uint32(OFF_T + i * AP + col)] = -(s0 + s1)
        else:
            for e in range(tid - BT, BT * BT, TPB - BT):     # zero above the diagonal
                i = e // BT
                m = e - i * BT
                if m > i:
                    smem[uint32(OFF_T + i * AP + m)] = f0
        ptx.cp_async_wait_all()
        cuda.syncthreads()

        # 4. W = T (b e^G ⊙ K), U = T (b ⊙ V): NB n8 tiles per batch, k8 steps over chunk rows 0..16w+15
        rt = OFF_T + (16 * w + gq) * AP + t
        for batch in range(NBATCH):
            is_w = batch * NB * 8 < S
            col0 = batch * NB * 8 - (0 if is_w else S)   # first column of the batch inside W or U
            for x in range(4 * NB):
                acc_k[x] = f0
            for ks in range(2 * w + 2):
                th0, th1, th2, th3, tl0, tl1, tl2, tl3 = load_t(smem, uint32(rt + 8 * ks))
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
                mma3_batch(acc_k, 0, NB, th0, th1, th2, th3, tl0, tl1, tl2, tl3, bfr)
            for nt in range(NB):
                for e in range(4):
                    i = 16 * w + gq + 8 * (e >> 1)
                    d = col0 + 8 * nt + 2 * t + (e & 1)
                    if i < c:
                        if is_w:
                            W_out[uint32(j), uint32(t0 + i), uint32(d)] = acc_k[4 * nt + e]
                        else:
                            U_out[uint32(j), uint32(t0 + i), uint32(d)] = acc_k[4 * nt + e]

    return chunk_intra_mma


def launch_chunk_intra_mma(ws, T: int, stream=0) -> None:
    """chunk_intra_mma over the first T rows of workspace ``ws`` (chunk.py's GdnPrefillWorkspace)."""
    kernel = chunk_intra_mma_kernel(ws.S, ws.Hk, ws.Hv)
    args = (ws.u, ws.beta, ws.g, ws.G, ws.W, ws.U, ws.P, T)
    nbytes = 4 * intra_smem_words(ws.S)
    allow_dynamic_smem(kernel, args, nbytes)
    kernel[((T + BT - 1) // BT, ws.Hv), TPB, stream, nbytes](*args)
