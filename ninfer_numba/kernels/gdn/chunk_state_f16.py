"""GDN prefill state pass on f16 tensor cores (mma m16n8k16, float32 accumulation): serial over chunks.

Computes the state pass of chunk_form.py. Every product takes float16 operands (W, q, k, P from the
workspace's f16 copies; h and V' rounded to f16 in shared memory) and accumulates in float32; the state h
itself stays float32, in the accumulator registers of the warps that update it, for the whole sequence.
(The previous version split every operand into tf32 hi + lo for float32 accuracy: three mma per product,
twice the shared memory, one block per SM at ~7 µs per chunk. The model's activations are int8 in every
GEMM, which is where its error comes from; see tests/kernels/gdn_cases.py for the budget of this pass.)

Block per (value tile of BV columns, value head), 8 warps. Per chunk of c <= BT rows:
  A  warp (rw = w % 4, cg = w // 4): chunk rows 16rw..+15, value columns cg·BV/2..+BV/2-1
     W h and Q h (h from the f16 plane, ldmatrix.trans); V' = U - W h -> s_v, e^(G_last - G) ⊙ V' -> s_vk
     (rows >= c zero); Q h scaled by e^G kept in registers
  B  the same tile: O = (e^G ⊙ Q h + P V') / √S -> o_out  (P's columns 0..16rw+15; zero above the diagonal)
  C  warp w: key tiles w, w + 8, ...: h <- e^(G_last) h + Kᵀ (e^(G_last - G) ⊙ V') in registers, then
     its f16 copy -> s_h (Kᵀ fragments by ldmatrix.trans of the k rows)
Two barriers per chunk: the next chunk's W, q, k and P rows are copied (cp.async) into the other of two
stages while the current one computes; its decay factors and U values are loaded a chunk ahead too.

Dynamic shared memory, uint32 words (f16 pairs unless noted); rows padded by 8 f16 so the 8 rows of an
ldmatrix phase start in 8 different 4-bank groups, and 16-byte aligned:
  per stage (two):  s_w, s_q, s_k [BT, S/2+4]   s_p [BT, BT/2+4]   s_eg, s_ek [BT] float32
  s_h [S, BV/2+4] (h row-major: key, value column)   s_v, s_vk [BT, BV/2+4] (V' row-major)
141 KiB at S = 128, BV = 32: one block per SM.
"""
import math
from functools import lru_cache

from numba import float32, types, uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.dynamic_smem import allow_dynamic_smem
from ninfer_numba.kernels.flash_attn.mma_f16 import mma_into, pack_f16x2
from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.gdn.row_stage import make_row_stager
from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, sm_count
from ninfer_numba.kernels.ptx import ldmatrix_x4, ldmatrix_x4_trans

N_WARPS = 8
TPB = 32 * N_WARPS
ROW_BLOCKS = BT // 16            # m16 row blocks of a chunk (phases A, B)
COL_GROUPS = N_WARPS // ROW_BLOCKS


def state_tile(S: int, Hv: int = 1, n_sm: int = 0, bv: int | None = None) -> int:
    """BV, the value columns per block: ``bv`` when given; else 32 (S below that: S), or 64 where 32 would
    make more blocks (S/BV per value head) than the n_sm SMs run at once: one block fits an SM (shared
    memory and registers), and a second wave doubles the serial pass (27B, 48 heads: 192 blocks of 32
    columns took 766 µs at 8K on an H200, 96 blocks of 64 took 549; the 9B's 128 of 32 took 375, of 64 527)."""
    if bv is not None:
        BV = bv
    else:
        BV = min(32, S)
        if n_sm and (S // BV) * Hv > n_sm and S % 64 == 0:
            BV = 64
    if S % BV != 0 or BV % (8 * COL_GROUPS) != 0:
        raise ValueError(f"value tile {BV} must divide S={S} and be a multiple of {8 * COL_GROUPS}")
    return BV


def _layout(S: int, BV: int) -> dict:
    """Word offsets and row strides of the shared-memory tiles."""
    RS = S // 2 + 4                  # s_w, s_q, s_k rows
    PS = BT // 2 + 4                 # s_p rows
    VS = BV // 2 + 4                 # s_h, s_v, s_vk rows
    lay = {"RS": RS, "PS": PS, "VS": VS, "Q": BT * RS, "K": 2 * BT * RS, "P": 3 * BT * RS}
    lay["EG"] = lay["P"] + BT * PS
    lay["EK"] = lay["EG"] + BT
    lay["STAGE"] = lay["EK"] + BT            # words of one stage
    lay["H"] = 2 * lay["STAGE"]
    lay["V"] = lay["H"] + S * VS
    lay["VK"] = lay["V"] + BT * VS
    lay["WORDS"] = lay["VK"] + BT * VS
    return lay


def state_smem_bytes(S: int, BV: int) -> int:
    return 4 * _layout(S, BV)["WORDS"]


@lru_cache(maxsize=None)
def chunk_state_f16_kernel(S: int, Hk: int, Hv: int, BV: int):
    if S % 16 != 0:
        raise ValueError(f"S={S} must be a multiple of 16")
    lay = _layout(S, BV)
    RS, PS, VS = lay["RS"], lay["PS"], lay["VS"]
    OFF_Q, OFF_K, OFF_P, OFF_EG, OFF_EK = lay["Q"], lay["K"], lay["P"], lay["EG"], lay["EK"]
    STAGE, OFF_H, OFF_V, OFF_VK = lay["STAGE"], lay["H"], lay["V"], lay["VK"]
    S2 = S // 2                  # words of an f16 row of S
    NTV = BV // 8                # n8 tiles of a value tile (phase C)
    NTW = NTV // COL_GROUPS      # n8 tiles of a warp in phases A and B
    PW = max(1, NTW // 2)        # ldmatrix.x4 loads of B fragments per k16 step in A and B (two tiles each)
    KS = S // 16                 # k16 steps over keys
    MT = S // 16                 # key m16 tiles of the state
    MTW = (MT + N_WARPS - 1) // N_WARPS
    ACC_A = 4 * NTW              # accumulator words of a warp's m16 x (BV / COL_GROUPS) tile
    ACC_H = 4 * NTV * MTW        # the warp's rows of h: [key tile, n8 tile, c0..c3]
    QK_ROW = 2 * Hk * S2         # words of a q|k row of the f16 copy
    HVS = Hv * S                 # row length of o_out
    SCALE = float32(1.0 / math.sqrt(S))
    f0 = float32(0.0)
    stage_s = make_row_stager(TPB, S // 8, BT)           # rows of S f16: W, q, k
    stage_p = make_row_stager(TPB, BT // 8, BT)          # rows of BT f16: P

    @cuda.jit(device=True, inline=True)
    def stage_chunk(smem_f, W16, qk16, P16, j, kh, Tw, t0, c, st):
        """cp.async the W, q, k (rows >= c zero) and P rows of the chunk at t0 into stage st; no commit."""
        base = st * STAGE
        stage_s(smem_f, base, RS, W16, (j * Tw + t0) * S2, S2, c, False)
        stage_s(smem_f, base + OFF_Q, RS, qk16, t0 * QK_ROW + kh * S2, QK_ROW, c, False)
        stage_s(smem_f, base + OFF_K, RS, qk16, t0 * QK_ROW + (Hk + kh) * S2, QK_ROW, c, True)
        stage_p(smem_f, base + OFF_P, PS, P16, (j * Tw + t0) * (BT // 2), BT // 2, c, False)

    @cuda.jit(device=True, inline=True)
    def load_g(G_cum, j, t0, c):
        """(G_i, G_last) of the chunk at t0 for thread i < BT: loaded a chunk ahead of their use."""
        tid = cuda.threadIdx.x
        return G_cum[uint32(j), uint32(t0 + min(tid, c - 1))], G_cum[uint32(j), uint32(t0 + c - 1)]

    @cuda.jit(device=True, inline=True)
    def put_decay(smem_f, st, c, gi, g_last):
        """e^(G_i) and e^(G_last - G_i) (0 past the chunk's end) of thread i < BT into stage st."""
        tid = cuda.threadIdx.x
        if tid < BT:
            smem_f[uint32(st * STAGE + OFF_EG + tid)] = math.exp(gi)
            smem_f[uint32(st * STAGE + OFF_EK + tid)] = math.exp(g_last - gi) if tid < c else f0

    @cuda.jit(device=True, inline=True)
    def load_u(U, ureg, u_base, c):
        """U at the warp's accumulator positions (rows >= c are never used: clamped to c - 1)."""
        lane = cuda.threadIdx.x & 31
        rw = (cuda.threadIdx.x >> 5) % ROW_BLOCKS
        for nt in range(NTW):
            for e in range(4):
                i = min(16 * rw + (lane >> 2) + 8 * (e >> 1), c - 1)
                ureg[4 * nt + e] = U[u_base + uint32(i * S + 8 * nt + (e & 1))]

    occupancy = {} if SIMULATOR else {"launch_bounds": (TPB, 1)}

    @cached_jit(**occupancy)
    def chunk_state_f16(qk16, G_cum, W16, U, P16, state, o_out, T):
        # qk16: [T·2·Hk·S/2] u32 (f16 pairs of the L2-normalised q | k heads, flat), G_cum: [Hv, T] f32,
        # W16: [Hv·Tw·S/2] u32 (f16 pairs, flat), U: [Hv·Tw·S] f32 (flat), P16: [Hv·Tw·BT/2] u32 (f16 pairs),
        # state: [Hv, S, S] f32 (in/out), o_out: [T·Hv·S] f32 (flat) raw (un-normalised) output.
        # Flat views and 32-bit offsets from a per-chunk base (offsets < 2^32 for any T the workspace allows).
        smem = cuda.shared.array(0, types.uint32, alignment=16)
        smem_f = cuda.shared.array(0, types.float32, alignment=16)   # the same bytes (dynamic arrays alias)
        acc_w = cuda.local.array(ACC_A, float32)         # [n8 tile of the warp, c0..c3] W h
        acc_q = cuda.local.array(ACC_A, float32)         # Q h, then the output
        acc_h = cuda.local.array(ACC_H, float32)         # the warp's rows of h, float32, the whole sequence
        u_cur = cuda.local.array(ACC_A, float32)         # U at the accumulator positions, this chunk
        u_nxt = cuda.local.array(ACC_A, float32)         # and the next
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
        Tw = W16.size // (Hv * S2)
        n_chunks = (T + BT - 1) // BT
        # ldmatrix lane addresses (words, relative to a tile's start), mma_f16.py's fragment layouts:
        a_row = (lane & 15) * RS + 4 * (lane >> 4)               # A of a row-major tile: W, q rows
        a_rowp = (lane & 15) * PS + 4 * (lane >> 4)              # P rows
        b_tr = ((lane & 7) + 8 * ((lane >> 3) & 1)) * VS + 4 * (lane >> 4)   # B of a row-major [k, n]: h, V'
        a_tr = ((lane & 7) + 8 * (lane >> 4)) * RS + 4 * ((lane >> 3) & 1)   # Kᵀ A from k rows [row, key]

        # h: the warp's key tiles from state into registers and the f16 plane
        for m in range(MTW):
            mt = w + N_WARPS * m
            if mt < MT:
                for nt in range(NTV):
                    for eh in range(2):
                        key = 16 * mt + gq + 8 * eh
                        col = 8 * nt + 2 * t
                        x0 = state[uint32(j), uint32(key), uint32(v0 + col)]
                        x1 = state[uint32(j), uint32(key), uint32(v0 + col + 1)]
                        acc_h[4 * (NTV * m + nt) + 2 * eh] = x0
                        acc_h[4 * (NTV * m + nt) + 2 * eh + 1] = x1
                        smem[uint32(OFF_H + key * VS + col // 2)] = pack_f16x2(x0, x1)
        c = min(BT, T)
        stage_chunk(smem_f, W16, qk16, P16, j, kh, Tw, 0, c, 0)
        ptx.cp_async_commit()
        gi, g_last = load_g(G_cum, j, 0, c)
        put_decay(smem_f, 0, c, gi, g_last)
        load_u(U, u_nxt, uint32(j * Tw * S + v0 + cb + 2 * t), c)

        for n in range(n_chunks):
            t0 = n * BT
            c = min(BT, T - t0)
            st = n & 1
            sb = st * STAGE
            ptx.cp_async_wait_all()
            cuda.syncthreads()                           # stage st, its decay factors and h's plane visible
            for x in range(ACC_A):
                u_cur[x] = u_nxt[x]
            if n + 1 < n_chunks:                         # the next chunk in flight for this whole chunk
                c1 = min(BT, T - t0 - BT)
                stage_chunk(smem_f, W16, qk16, P16, j, kh, Tw, t0 + BT, c1, 1 - st)
                gi, g_last = load_g(G_cum, j, t0 + BT, c1)
                load_u(U, u_nxt, uint32((j * Tw + t0 + BT) * S + v0 + cb + 2 * t), c1)
            ptx.cp_async_commit()

            # A. W h and Q h, sharing h's B fragments
            for x in range(ACC_A):
                acc_w[x] = f0
                acc_q[x] = f0
            aw = uint32(sb + 16 * rw * RS + a_row)
            bh = uint32(OFF_H + cb // 2 + b_tr)
            for ks in range(KS):
                w0, w1, w2, w3 = ldmatrix_x4(smem, aw + uint32(8 * ks))
                q0, q1, q2, q3 = ldmatrix_x4(smem, aw + uint32(OFF_Q + 8 * ks))
                for p in range(PW):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, bh + uint32(16 * ks * VS + 8 * p))
                    mma_into(acc_w, 8 * p, w0, w1, w2, w3, b0, b1)
                    mma_into(acc_q, 8 * p, q0, q1, q2, q3, b0, b1)
                    if NTW > 1:
                        mma_into(acc_w, 8 * p + 4, w0, w1, w2, w3, b2, b3)
                        mma_into(acc_q, 8 * p + 4, q0, q1, q2, q3, b2, b3)
            for eh in range(2):                          # V' = U - W h and e^(G_last - G) ⊙ V' (rows >= c: 0)
                i = 16 * rw + gq + 8 * eh
                eg = smem_f[uint32(sb + OFF_EG + i)]
                ek = smem_f[uint32(sb + OFF_EK + i)]
                for nt in range(NTW):
                    x = 4 * nt + 2 * eh
                    v0_ = u_cur[x] - acc_w[x] if i < c else f0
                    v1_ = u_cur[x + 1] - acc_w[x + 1] if i < c else f0
                    p = uint32(i * VS + (cb + 8 * nt) // 2 + t)
                    smem[OFF_V + p] = pack_f16x2(v0_, v1_)
                    smem[OFF_VK + p] = pack_f16x2(ek * v0_, ek * v1_)
                    acc_q[x] *= eg
                    acc_q[x + 1] *= eg
            cuda.syncthreads()                           # V' complete

            # B. O = (e^G ⊙ Q h + P V') / √S for the warp's tile; P's k16 steps up to the diagonal block
            ap = uint32(sb + OFF_P + 16 * rw * PS + a_rowp)
            bv = uint32(OFF_V + cb // 2 + b_tr)
            for ks in range(rw + 1):
                p0, p1, p2, p3 = ldmatrix_x4(smem, ap + uint32(8 * ks))
                for p in range(PW):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, bv + uint32(16 * ks * VS + 8 * p))
                    mma_into(acc_q, 8 * p, p0, p1, p2, p3, b0, b1)
                    if NTW > 1:
                        mma_into(acc_q, 8 * p + 4, p0, p1, p2, p3, b2, b3)
            o_base = uint32(t0 * HVS + j * S + v0 + cb + 2 * t)      # o_out[t0, j·S + v0 + cb + 2t], flat
            for nt in range(NTW):
                for e in range(4):
                    i = 16 * rw + gq + 8 * (e >> 1)
                    if i < c:
                        o_out[o_base + uint32(i * HVS + 8 * nt + (e & 1))] = acc_q[4 * nt + e] * SCALE

            # C. h <- e^(G_last) h + Kᵀ (e^(G_last - G) ⊙ V') for the warp's key tiles; then h's f16 plane
            e_last = smem_f[uint32(sb + OFF_EG + c - 1)]
            for m in range(MTW):
                mt = w + N_WARPS * m
                if mt < MT:
                    for x in range(4 * NTV):
                        acc_h[4 * NTV * m + x] *= e_last
                    ak = uint32(sb + OFF_K + 8 * mt + a_tr)
                    for ks in range(BT // 16):
                        k0, k1, k2, k3 = ldmatrix_x4_trans(smem, ak + uint32(16 * ks * RS))
                        for p in range(NTV // 2):
                            b0, b1, b2, b3 = ldmatrix_x4_trans(smem, uint32(OFF_VK + b_tr + 16 * ks * VS + 8 * p))
                            mma_into(acc_h, 4 * NTV * m + 8 * p, k0, k1, k2, k3, b0, b1)
                            mma_into(acc_h, 4 * NTV * m + 8 * p + 4, k0, k1, k2, k3, b2, b3)
                    for nt in range(NTV):
                        for eh in range(2):
                            x = 4 * (NTV * m + nt) + 2 * eh
                            key = 16 * mt + gq + 8 * eh
                            smem[uint32(OFF_H + key * VS + 4 * nt + t)] = pack_f16x2(acc_h[x], acc_h[x + 1])
            if n + 1 < n_chunks:                         # the next chunk's decay factors into the other stage
                put_decay(smem_f, 1 - st, min(BT, T - t0 - BT), gi, g_last)

        for m in range(MTW):
            mt = w + N_WARPS * m
            if mt < MT:
                for nt in range(NTV):
                    for e in range(4):
                        key = 16 * mt + gq + 8 * (e >> 1)
                        state[uint32(j), uint32(key), uint32(v0 + 8 * nt + 2 * t + (e & 1))] = \
                            acc_h[4 * (NTV * m + nt) + e]

    return chunk_state_f16


def launch_chunk_state_f16(ws, state, o_out, T: int, stream=0, bv: int | None = None) -> None:
    """chunk_state_f16 over the first T rows of workspace ``ws``: state [Hv, S, S] in/out, o_out [T, Hv*S].
    bv: value columns per block (default state_tile's for this device)."""
    n_sm = 0 if SIMULATOR else sm_count()
    BV = state_tile(ws.S, ws.Hv, n_sm, bv)
    kernel = chunk_state_f16_kernel(ws.S, ws.Hk, ws.Hv, BV)
    args = (ws.qk16_words, ws.G, ws.W16_words, ws.U_flat, ws.P16_words, state, o_out.reshape(o_out.size), T)
    nbytes = state_smem_bytes(ws.S, BV)
    allow_dynamic_smem(kernel, args, nbytes)
    kernel[(ws.S // BV, ws.Hv), TPB, stream, nbytes](*args)
