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

Outputs (prefill workspace, chunk_form.py): G_out [Hv, T], U_out [Hv, T, S] float32; W_out [Hv, T, S] and
P_out [Hv, T, BT] float16 (the state pass's operands; P row i, columns 0..16·(i//16)+15 written, zero above
the diagonal), written as packed pairs.
"""
import math
from functools import lru_cache

from numba import float32, types, uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.dynamic_smem import allow_dynamic_smem
from ninfer_numba.kernels.flash_attn.mma_f16 import mma_into, pack_f16x2
from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.gdn.row_stage import make_row_stager
from ninfer_numba.kernels.gdn.tri_inverse import make_tri_inverse
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.mma_tf32 import make_a_split_ldmatrix, make_mma3_tiles, split_tf32
from ninfer_numba.kernels.ptx import ldmatrix_x4
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
    return 2 * BT * (S // 2 + 4) + BT * (S + 8) + 2 * BT * AP + 3 * BT


@lru_cache(maxsize=None)
def chunk_intra_mma_kernel(S: int, Hk: int, Hv: int):
    if Hv % Hk != 0 or S % 16 != 0:
        raise ValueError(f"need Hv % Hk == 0 and S % 16 == 0 (Hk={Hk}, Hv={Hv}, S={S})")
    KP = S // 2 + 4              # words of an f16 k or q row (8 f16 of padding)
    VP = S + 8
    OFF_Q = BT * KP
    OFF_V = 2 * BT * KP
    OFF_A = OFF_V + BT * VP
    OFF_T = OFF_A + BT * AP
    OFF_B = OFF_T + BT * AP
    OFF_G = OFF_B + BT
    OFF_BG = OFF_G + BT
    KS = S // 16                 # k16 steps over the head dimension (K Kᵀ, Q Kᵀ)
    S2 = S // 2                  # words of an f16 head row
    QK_ROW = 2 * Hk * S2         # words of a q|k row of qk16
    NB = max(d for d in range(1, 9) if (S // 8) % d == 0)     # n8 tiles per batch of W or U
    NBATCH = S // (8 * NB)
    ACC_KQ = 4 * 5               # accumulator words of a warp's 5 (row tile, n8 tile) slots of K Kᵀ / Q Kᵀ
    ACC_B = 4 * NB               # accumulator words of a batch of W or U on one row tile
    BFR = 4 * NB
    f0 = float32(0.0)
    mma3_batch = make_mma3_tiles(NB)
    tri_inverse = make_tri_inverse(AP, OFF_A, OFF_T)
    load_t = make_a_split_ldmatrix(AP)           # T rows
    stage_qk = make_row_stager(TPB, S // 8, BT)  # rows of S f16: k, q
    stage_v = make_row_stager(TPB, S // 4, BT)   # rows of S f32: v

    @cuda.jit(device=True, inline=True)
    def kq_products(smem_u, acc_k, acc_q, w, ra1, ra2, N1):
        """K Kᵀ and Q Kᵀ of the warp's 5 slots, the first N1 on the row tile at word ra1, the rest at ra2: one
        f16 mma per k16 step and slot (q and k are float16 values, so the products are exact and only the
        float32 accumulation rounds, as the split tf32 products did on the float32 rows)."""
        lane = cuda.threadIdx.x & 31
        a_off = (lane & 15) * KP + 4 * (lane >> 4)            # A fragment of a row-major f16 tile
        for ks in range(KS):
            k0, k1, k2, k3 = ldmatrix_x4(smem_u, uint32(ra1 + a_off + 8 * ks))
            q0, q1, q2, q3 = ldmatrix_x4(smem_u, uint32(OFF_Q + ra1 + a_off + 8 * ks))
            k4 = k5 = k6 = k7 = q4 = q5 = q6 = q7 = uint32(0)     # (typed on every path)
            if N1 < 5:
                k4, k5, k6, k7 = ldmatrix_x4(smem_u, uint32(ra2 + a_off + 8 * ks))
                q4, q5, q6, q7 = ldmatrix_x4(smem_u, uint32(OFF_Q + ra2 + a_off + 8 * ks))
            for s2 in range(3):                          # B[k, n] = K[8nt + n, k]: k rows, slots in pairs
                sa = 2 * s2
                sb = min(2 * s2 + 1, 4)
                _, nt = kq_slot(5 * w + (sb if lane >= 16 else sa))
                b0, b1, b2, b3 = ldmatrix_x4(smem_u, uint32((8 * nt + (lane & 7)) * KP + 8 * ks
                                                            + 4 * ((lane >> 3) & 1)))
                for half in range(2):
                    s = sa if half == 0 else sb
                    if half == 0 or sb != sa:
                        c0 = b0 if half == 0 else b2
                        c1 = b1 if half == 0 else b3
                        if s < N1:
                            mma_into(acc_k, 4 * s, k0, k1, k2, k3, c0, c1)
                            mma_into(acc_q, 4 * s, q0, q1, q2, q3, c0, c1)
                        else:
                            mma_into(acc_k, 4 * s, k4, k5, k6, k7, c0, c1)
                            mma_into(acc_q, 4 * s, q4, q5, q6, q7, c0, c1)

    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 2)}

    @cached_jit(**occupancy)
    def chunk_intra_mma(v, qk16, beta, g, G_out, W_out, U_out, P_out, T):
        # v: [T, Hv·S] f32, qk16: [T·2·Hk·S/2] u32 (f16 pairs of the L2-normalised q | k heads, flat),
        # beta, g: [T, Hv] f32 -> G_out: [Hv, T] f32, W_out: [Hv, T, S/2] u32 (f16 pairs),
        # U_out: [Hv, T, S] f32, P_out: [Hv, T, BT/2] u32 (f16 pairs)
        smem = cuda.shared.array(0, types.float32, alignment=16)
        smem_u = cuda.shared.array(0, types.uint32, alignment=16)    # the same bytes: f16 pairs
        smem_h = cuda.shared.array(0, types.float16, alignment=16)   # and single f16
        acc_k = cuda.local.array(ACC_KQ, float32)       # [slot, c0..c3] K Kᵀ
        acc_q = cuda.local.array(ACC_KQ, float32)       # [slot, c0..c3] Q Kᵀ
        acc_hi = cuda.local.array(ACC_B, float32)      # [n8 tile, c0..c3] W or U rows of tile r_hi
        acc_lo = cuda.local.array(ACC_B, float32)      # and of tile r_lo
        bfr = cuda.local.array(BFR, types.uint32)       # [n8 tile, hi0, hi1, lo0, lo1] B fragments of W, U
        p_pair = cuda.local.array(2, float32)           # two adjacent columns of a P row, packed to f16
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        gq = lane >> 2
        t = lane & 3
        t0 = cuda.blockIdx.x * BT
        j = cuda.blockIdx.y
        kh = j % Hk
        c = min(BT, T - t0)

        ncol = v.shape[1]
        stage_qk(smem, 0, KP, qk16, t0 * QK_ROW + (Hk + kh) * S2, QK_ROW, c, True)
        stage_qk(smem, OFF_Q, KP, qk16, t0 * QK_ROW + kh * S2, QK_ROW, c, True)
        ptx.cp_async_commit()
        stage_v(smem, OFF_V, VP, v, t0 * ncol + j * S, ncol, c, True)     # used in step 4
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
        ptx.cp_async_wait_1()
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
        ra1 = 16 * r1 * KP                               # A[0, 0] of row tile r1 in s_k / s_q
        ra2 = 16 * r2 * KP
        if n1 == 5:                                      # N1 a constant in each copy: no branch per mma
            kq_products(smem_u, acc_k, acc_q, w, ra1, ra2, 5)
        elif n1 == 3:
            kq_products(smem_u, acc_k, acc_q, w, ra1, ra2, 3)
        else:
            kq_products(smem_u, acc_k, acc_q, w, ra1, ra2, 1)
        for s in range(5):
            r, nt = kq_slot(5 * w + s)
            for eh in range(2):
                i = 16 * r + gq + 8 * eh
                for e1 in range(2):
                    jj = 8 * nt + 2 * t + e1
                    x = 4 * s + 2 * eh + e1
                    p_pair[e1] = f0
                    if jj <= i:
                        decay = math.exp(smem[uint32(OFF_G + i)] - smem[uint32(OFF_G + jj)])      # exponent <= 0
                        p_pair[e1] = acc_q[x] * decay
                        if jj < i:
                            smem[uint32(OFF_A + i * AP + jj)] = smem[uint32(OFF_B + i)] * acc_k[x] * decay
                if i < c:
                    P_out[uint32(j), uint32(t0 + i), uint32(4 * nt + t)] = pack_f16x2(p_pair[0], p_pair[1])
        cuda.syncthreads()                               # A complete

        # 3. T = (I + A)⁻¹ by 16x16 blocks (tri_inverse.py) while the v rows may still fly
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
                    if is_w:                             # k rows: f16 (2 per word)
                        s0 = smem[uint32(OFF_BG + r0)]
                        s1 = smem[uint32(OFF_BG + r1)]
                        for nt in range(NB):
                            x0 = float32(smem_h[uint32(2 * r0 * KP + col0 + gq + 8 * nt)])
                            x1 = float32(smem_h[uint32(2 * r1 * KP + col0 + gq + 8 * nt)])
                            bfr[4 * nt], bfr[4 * nt + 2] = split_tf32(s0 * x0)
                            bfr[4 * nt + 1], bfr[4 * nt + 3] = split_tf32(s1 * x1)
                    else:
                        s0 = smem[uint32(OFF_B + r0)]
                        s1 = smem[uint32(OFF_B + r1)]
                        p0 = OFF_V + r0 * VP + col0 + gq
                        p1 = OFF_V + r1 * VP + col0 + gq
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
                        if (e & 1) == 0:                 # W as f16 pairs (columns d, d + 1)
                            if i_hi < c:
                                W_out[uint32(j), uint32(t0 + i_hi), uint32(d // 2)] = pack_f16x2(
                                    acc_hi[4 * nt + e], acc_hi[4 * nt + e + 1])
                            if i_lo < c:
                                W_out[uint32(j), uint32(t0 + i_lo), uint32(d // 2)] = pack_f16x2(
                                    acc_lo[4 * nt + e], acc_lo[4 * nt + e + 1])
                    else:
                        if i_hi < c:
                            U_out[uint32(j), uint32(t0 + i_hi), uint32(d)] = acc_hi[4 * nt + e]
                        if i_lo < c:
                            U_out[uint32(j), uint32(t0 + i_lo), uint32(d)] = acc_lo[4 * nt + e]

    return chunk_intra_mma


def launch_chunk_intra_mma(ws, T: int, stream=0) -> None:
    """chunk_intra_mma over the first T rows of workspace ``ws`` (chunk.py's GdnPrefillWorkspace)."""
    kernel = chunk_intra_mma_kernel(ws.S, ws.Hk, ws.Hv)
    args = (ws.v, ws.qk16_words, ws.beta, ws.g, ws.G, ws.W16_pairs, ws.U, ws.P16_pairs, T)
    nbytes = 4 * intra_smem_words(ws.S)
    allow_dynamic_smem(kernel, args, nbytes)
    kernel[((T + BT - 1) // BT, ws.Hv), TPB, stream, nbytes](*args)
