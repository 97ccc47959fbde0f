"""GDN prefill state pass v3 on tensor cores (3xTF32 mma.sync): serial over chunks, outputs fused.

Computes the state pass of chunk_form.py. v2 (chunk_state_staged.py) ran the four products of each chunk
step as CUDA-core FMAs from shared memory, issue-bound at 5.7 ms per 9B layer per 8K tokens. Here every
product is a warp-level mma at float32 accuracy (mma_tf32.py), and the next chunk's operands are copied
(cp.async) while the current one computes.

Block per (value tile of BV columns, value head), 8 warps (one warp per scheduler left each stalled on its
own latencies: 4 warps ran at ~0.3 instructions per cycle). Per chunk of c <= BT rows, warp w owns chunk rows
16·(w % 4)..+15 and half the value columns (w // 4) in the first two phases, key m16 tile w in the third:
  A  V' = U - W h and Q h             h (B operand) from s_hh/s_hl; W, Q rows (A) from s_w, s_q
     V' -> s_vh/s_vl (chunk rows >= c set to 0)
  B  O = (e^G ⊙ Q h + P V') / √S -> o_out    P rows (A) from s_p, V' (B) from s_vh/s_vl
  C  h <- e^(G_last) h + (e^(G_last - G) ⊙ K)ᵀ V'   K rows (A, transposed) from s_k, V' (B)
Pipeline: W, Q of chunk n+1 are copied during B and C of chunk n; K, P of chunk n+1 during A of n+1.
Three barriers per chunk. The B operands (h, V') are stored already split (tf32 hi and lo planes) and
transposed (row = value column, along the contraction) by the phase that writes them, so that one
``ldmatrix.x4`` per plane loads the B fragments of two n8 tiles; the A operands W, Q and P are loaded the
same way from their row-major tiles (mma_tf32.make_*_ldmatrix): a quarter of the shared-memory load
instructions of scalar fragment loads and their address arithmetic (SASS of the phase A loop: 145 -> 103
instructions per 24 mma). h also keeps its float32 master copy s_h.

Dynamic shared memory, 4-byte words, rows padded for conflict-free reads and 16-byte aligned for ldmatrix:
  s_w, s_q [BT, S+4] f32   s_k [BT, S+8] f32   s_p [BT, BT+4] f32   s_h [S, BV+8] f32
  s_hh, s_hl [BV, S+4] tf32 (h transposed)   s_vh, s_vl [BV, BT+4] tf32 (V' transposed)   s_eg, s_ek [BT] f32
188 KiB at S = 128, BV = 32: one block per SM.
"""
import math
from functools import lru_cache

from numba import float32, types, uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.dynamic_smem import allow_dynamic_smem
from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.gdn.row_stage import make_row_stager
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.mma_tf32 import make_a_split_ldmatrix, make_b_ldmatrix, make_mma3_tiles, split_tf32
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

N_WARPS = 8
TPB = 32 * N_WARPS
ROW_BLOCKS = 4                   # m16 row blocks of a chunk (BT = 64 rows)
COL_GROUPS = N_WARPS // ROW_BLOCKS
PP = BT + 4                      # row stride of s_p


def state_tile(S: int) -> int:
    """BV, the value columns per block: 32, or S below that."""
    return min(32, S)


def state_smem_words(S: int) -> int:
    BV = state_tile(S)
    return 2 * BT * (S + 4) + BT * (S + 8) + BT * PP + S * (BV + 8) + 2 * BV * (S + 4) + 2 * BV * (BT + 4) + 2 * BT


@lru_cache(maxsize=None)
def chunk_state_mma_kernel(S: int, Hk: int, Hv: int):
    if S % 16 != 0:
        raise ValueError(f"S={S} must be a multiple of 16")
    BV = state_tile(S)
    WP = S + 4
    KP = S + 8
    HP = BV + 8                  # row stride of the float32 master h [S, BV]
    HT = S + 4                   # row stride of the transposed tf32 planes of h [BV, S]
    VT = BT + 4                  # row stride of the transposed tf32 planes of V' [BV, BT]
    OFF_Q = BT * WP
    OFF_K = 2 * BT * WP
    OFF_P = OFF_K + BT * KP
    OFF_H = OFF_P + BT * PP
    OFF_HH = OFF_H + S * HP
    OFF_HL = OFF_HH + BV * HT
    OFF_VH = OFF_HL + BV * HT
    OFF_VL = OFF_VH + BV * VT
    OFF_EG = OFF_VL + BV * VT
    OFF_EK = OFF_EG + BT
    NTV = BV // 8                # n8 tiles of a value tile
    KS = S // 8                  # k8 steps over keys
    MT = S // 16                 # key m16 tiles of the state
    MTW = (MT + N_WARPS - 1) // N_WARPS
    MT_FULL = MT % N_WARPS == 0  # every warp has MTW key tiles: no per-tile test (it split the mma into blocks)
    NTW = NTV // COL_GROUPS      # n8 tiles of a warp in phases A and B
    ACC_V = 4 * NTV              # fragment words of one m16 x BV tile (array sizes must be plain constants)
    ACC_A = 4 * NTW              # accumulator words of a warp's m16 x (BV / COL_GROUPS) tile
    ACC_H = 4 * NTV * MTW
    K0 = Hk * S
    HVS = Hv * S                 # row length of o_out
    SCALE = float32(1.0 / math.sqrt(S))
    f0 = float32(0.0)
    mma3_a = make_mma3_tiles(NTW)
    mma3_c = make_mma3_tiles(NTV)
    load_w = make_a_split_ldmatrix(WP)           # W and q rows
    load_p = make_a_split_ldmatrix(PP)           # P rows
    stage_s = make_row_stager(TPB, S // 4, BT)          # rows of S floats: W, q, k
    stage_p = make_row_stager(TPB, BT // 4, BT)         # rows of BT floats: P

    @cuda.jit(device=True, inline=True)
    def put_h(smem, smem_u, key, col, x):
        """h[key, col] = x: the float32 master and its tf32 hi / lo planes (transposed)."""
        smem[uint32(OFF_H + key * HP + col)] = x
        p = col * HT + key
        smem_u[uint32(OFF_HH + p)], smem_u[uint32(OFF_HL + p)] = split_tf32(x)

    load_b_h = make_b_ldmatrix(HT, NTW)          # h planes, a warp's n8 tiles (phase A)
    load_b_va = make_b_ldmatrix(VT, NTW)         # V' planes, a warp's n8 tiles (phase B)
    load_b_vc = make_b_ldmatrix(VT, NTV)         # V' planes, all n8 tiles of the block (phase C)

    @cuda.jit(device=True, inline=True)
    def stage_wq(smem, W, u, j, kh, Tw, ncol, t0, c):
        """cp.async the W and q rows of the chunk at t0 (c rows); no commit."""
        stage_s(smem, 0, WP, W, (j * Tw + t0) * S, S, c, False)
        stage_s(smem, OFF_Q, WP, u, t0 * ncol + kh * S, ncol, c, False)

    @cuda.jit(device=True, inline=True)
    def load_g(G_cum, j, t0, c):
        """(G_i, G_last) of the chunk at t0 for thread i < BT (G_last past the chunk's end): loaded a chunk
        ahead, so the global latency is not on the serial path (it was 10 % of the kernel's stall samples)."""
        tid = cuda.threadIdx.x
        g_last = G_cum[uint32(j), uint32(t0 + c - 1)]
        gi = G_cum[uint32(j), uint32(t0 + min(tid, c - 1))]
        return gi, g_last

    @cuda.jit(device=True, inline=True)
    def stage_kp_decay(smem, u, P, j, kh, Tw, ncol, t0, c, gi, g_last):
        """cp.async the k rows (rows >= c zero) and P rows of the chunk at t0; its factors e^(G_i) and
        e^(G_last - G_i) (0 past the end) from load_g's values into s_eg, s_ek with plain stores; no commit."""
        stage_s(smem, OFF_K, KP, u, t0 * ncol + K0 + kh * S, ncol, c, True)
        stage_p(smem, OFF_P, PP, P, (j * Tw + t0) * BT, BT, c, False)
        tid = cuda.threadIdx.x
        if tid < BT:
            smem[uint32(OFF_EG + tid)] = math.exp(gi)
            smem[uint32(OFF_EK + tid)] = math.exp(g_last - gi) if tid < c else f0

    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 1)}

    @cached_jit(**occupancy)
    def chunk_state_mma(u, G_cum, W, U, P, state, o_out, T):
        # u: [T, C], G_cum: [Hv, T], W: [Hv, Tw, S], U: [Hv·Tw·S] (flat), P: [Hv, Tw, BT], state: [Hv, S, S]
        # (in/out), o_out: [T·Hv·S] (flat) raw (un-normalised) output; flat views and 32-bit offsets from a
        # per-chunk base (the 3-index forms cost 64-bit address arithmetic per element; offsets < 2^32 for
        # any T the workspace allows)
        smem = cuda.shared.array(0, types.float32, alignment=16)
        smem_u = cuda.shared.array(0, types.uint32, alignment=16)   # the same bytes (dynamic arrays alias)
        acc_w = cuda.local.array(ACC_A, float32)         # [n8 tile of the warp, c0..c3] W h
        acc_q = cuda.local.array(ACC_A, float32)         # Q h, then the output
        acc_h = cuda.local.array(ACC_H, float32)         # [key tile of the warp, n8 tile, c0..c3] new h
        u_reg = cuda.local.array(ACC_A, float32)         # U at the accumulator positions
        bfr = cuda.local.array(ACC_V, types.uint32)      # [n8 tile, hi0, hi1, lo0, lo1] B fragments
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        rw = w % ROW_BLOCKS                              # phases A, B: chunk rows 16rw..16rw+15
        cb = 8 * NTW * (w // ROW_BLOCKS)                 # and value columns cb..cb+8·NTW-1
        gq = lane >> 2
        t = lane & 3
        j = cuda.blockIdx.y
        kh = j % Hk
        v0 = cuda.blockIdx.x * BV
        ncol = u.shape[1]
        Tw = W.shape[1]
        n_chunks = (T + BT - 1) // BT

        for e in range(tid, S * BV, TPB):
            r = e // BV
            put_h(smem, smem_u, r, e - r * BV, state[uint32(j), uint32(r), uint32(v0 + e - r * BV)])
        # prologue: W, Q of chunk 0 (one group), then K, P and the e^G factors of chunk 0 (the next group)
        c = min(BT, T)
        stage_wq(smem, W, u, j, kh, Tw, ncol, 0, c)
        ptx.cp_async_commit()
        gi, g_last = load_g(G_cum, j, 0, c)
        stage_kp_decay(smem, u, P, j, kh, Tw, ncol, 0, c, gi, g_last)
        ptx.cp_async_commit()

        ra = 16 * rw * WP                                # A[0, 0] of the warp's rows in s_w / s_q
        for n in range(n_chunks):
            t0 = n * BT
            c = min(BT, T - t0)
            u_base = uint32((j * Tw + t0) * S + v0 + cb + 2 * t)         # U[j, t0, v0 + cb + 2t], flat
            o_base = uint32(t0 * HVS + j * S + v0 + cb + 2 * t)          # o_out[t0, j·S + v0 + cb + 2t], flat
            for nt in range(NTW):                        # U of my accumulator positions, in flight early
                for e in range(4):
                    i = min(16 * rw + gq + 8 * (e >> 1), c - 1)      # rows >= c are never used
                    u_reg[4 * nt + e] = U[u_base + uint32(i * S + 8 * nt + (e & 1))]
            if n + 1 < n_chunks:                         # the next chunk's G, in flight for the whole chunk
                gi, g_last = load_g(G_cum, j, t0 + BT, min(BT, T - t0 - BT))
            ptx.cp_async_wait_1()
            cuda.syncthreads()                           # W, Q of chunk n and h visible

            # A. W h and Q h (h's B fragments shared by both products)
            for x in range(ACC_A):
                acc_w[x] = f0
                acc_q[x] = f0
            for ks0 in range(0, KS, 2):             # pairs of k8 steps: one basic block for ptxas to schedule
                for uu in range(2):
                    ks = ks0 + uu
                    wh0, wh1, wh2, wh3, wl0, wl1, wl2, wl3 = load_w(smem_u, ra + 8 * ks)
                    qh0, qh1, qh2, qh3, ql0, ql1, ql2, ql3 = load_w(smem_u, OFF_Q + ra + 8 * ks)
                    load_b_h(smem_u, OFF_HH, OFF_HL, cb, 8 * ks, bfr)
                    mma3_a(acc_w, 0, 0, NTW, wh0, wh1, wh2, wh3, wl0, wl1, wl2, wl3, bfr)
                    mma3_a(acc_q, 0, 0, NTW, qh0, qh1, qh2, qh3, ql0, ql1, ql2, ql3, bfr)
            for nt in range(NTW):                        # V' = U - W h; rows past the chunk's end are 0
                for e in range(4):
                    i = 16 * rw + gq + 8 * (e >> 1)
                    p = (cb + 8 * nt + 2 * t + (e & 1)) * VT + i              # V' transposed: [column, row]
                    vn = u_reg[4 * nt + e] - acc_w[4 * nt + e] if i < c else f0
                    smem_u[uint32(OFF_VH + p)], smem_u[uint32(OFF_VL + p)] = split_tf32(vn)
            ptx.cp_async_wait_all()
            cuda.syncthreads()                           # V' complete; K, P visible; s_w, s_q free
            if n + 1 < n_chunks:
                stage_wq(smem, W, u, j, kh, Tw, ncol, t0 + BT, min(BT, T - t0 - BT))
            ptx.cp_async_commit()

            # B. O = (e^G ⊙ Q h + P V') / √S, P's columns 0..16rw+15 (zero above the diagonal)
            for nt in range(NTW):
                for e in range(4):
                    acc_q[4 * nt + e] *= smem[uint32(OFF_EG + 16 * rw + gq + 8 * (e >> 1))]
            rp = OFF_P + 16 * rw * PP
            for ks0 in range(0, 2 * rw + 2, 2):             # pairs of k8 steps: one basic block for ptxas to schedule
                for uu in range(2):
                    ks = ks0 + uu
                    ph0, ph1, ph2, ph3, pl0, pl1, pl2, pl3 = load_p(smem_u, rp + 8 * ks)
                    load_b_va(smem_u, OFF_VH, OFF_VL, cb, 8 * ks, bfr)
                    mma3_a(acc_q, 0, 0, NTW, ph0, ph1, ph2, ph3, pl0, pl1, pl2, pl3, bfr)
            for nt in range(NTW):
                for e in range(4):
                    i = 16 * rw + gq + 8 * (e >> 1)
                    if i < c:
                        o_out[o_base + uint32(i * HVS + 8 * nt + (e & 1))] = acc_q[4 * nt + e] * SCALE

            # C. h <- e^(G_last) h + K̃ᵀ V' for the warp's key tiles
            e_last = smem[uint32(OFF_EG + c - 1)]
            for m in range(MTW):
                mt = w + N_WARPS * m
                if MT_FULL or mt < MT:
                    for nt in range(NTV):
                        for e in range(4):
                            key = 16 * mt + gq + 8 * (e >> 1)
                            h_old = smem[uint32(OFF_H + key * HP + 8 * nt + 2 * t + (e & 1))]
                            acc_h[4 * (NTV * m + nt) + e] = e_last * h_old
            for ks0 in range(0, BT // 8, 2):             # pairs of k8 steps: one basic block for ptxas to schedule
                for uu in range(2):
                    ks = ks0 + uu
                    load_b_vc(smem_u, OFF_VH, OFF_VL, 0, 8 * ks, bfr)
                    r0 = 8 * ks + t                          # chunk rows of a0/a1 and a2/a3
                    s0 = smem[uint32(OFF_EK + r0)]
                    s1 = smem[uint32(OFF_EK + r0 + 4)]
                    for m in range(MTW):
                        mt = w + N_WARPS * m
                        if MT_FULL or mt < MT:
                            pk = OFF_K + r0 * KP + 16 * mt + gq     # A[key g, row t] = K[row t, key g]
                            ah0, al0 = split_tf32(s0 * smem[uint32(pk)])
                            ah1, al1 = split_tf32(s0 * smem[uint32(pk + 8)])
                            ah2, al2 = split_tf32(s1 * smem[uint32(pk + 4 * KP)])
                            ah3, al3 = split_tf32(s1 * smem[uint32(pk + 4 * KP + 8)])
                            mma3_c(acc_h, 4 * NTV * m, 0, NTV, ah0, ah1, ah2, ah3, al0, al1, al2, al3, bfr)
            for m in range(MTW):
                mt = w + N_WARPS * m
                if MT_FULL or mt < MT:
                    for nt in range(NTV):
                        for e in range(4):
                            put_h(smem, smem_u, 16 * mt + gq + 8 * (e >> 1), 8 * nt + 2 * t + (e & 1),
                                  acc_h[4 * (NTV * m + nt) + e])
            cuda.syncthreads()                           # h complete; s_k, s_p, V' and the factors free
            if n + 1 < n_chunks:
                stage_kp_decay(smem, u, P, j, kh, Tw, ncol, t0 + BT, min(BT, T - t0 - BT), gi, g_last)
            ptx.cp_async_commit()

        for e in range(tid, S * BV, TPB):
            r = e // BV
            state[uint32(j), uint32(r), uint32(v0 + e - r * BV)] = smem[uint32(OFF_H + r * HP + e - r * BV)]

    return chunk_state_mma


def launch_chunk_state_mma(ws, state, o_out, T: int, stream=0) -> None:
    """chunk_state_mma over the first T rows of workspace ``ws``: state [Hv, S, S] in/out, o_out [T, Hv*S]."""
    kernel = chunk_state_mma_kernel(ws.S, ws.Hk, ws.Hv)
    args = (ws.u, ws.G, ws.W, ws.U.reshape(ws.U.size), ws.P, state, o_out.reshape(o_out.size), T)
    nbytes = 4 * state_smem_words(ws.S)
    allow_dynamic_smem(kernel, args, nbytes)
    kernel[(ws.S // state_tile(ws.S), ws.Hv), TPB, stream, nbytes](*args)
