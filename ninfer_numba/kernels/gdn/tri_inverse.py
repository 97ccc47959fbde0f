"""T = (I + A)⁻¹ of one 64-row chunk by 16x16 blocks, for the tensor-core intra-chunk kernel.

A is strictly lower triangular (BT x BT), so L = I + A is unit lower triangular and so is T. By 16-row
blocks (i, j = 0..3), with T_ii = (I + A_ii)⁻¹, the columns of T L = I below the diagonal give

    T_ij = -T_ii · Σ_{j <= k < i} A_ik T_kj        (i > j)

which involves only column block j of T: every n8 column tile of T is its own recurrence down the
blocks. Two steps, four warps:
  a. warp w inverts diagonal block w by forward substitution, lane col < 16 its column (a chain of at
     most 15 rows of at most 15 terms: the one-column-per-thread substitution over all 64 rows was up to
     63 rows of 63 terms, the intra kernel's longest path); lanes 16..31 zero the block above its diagonal
  b. (after a barrier) each warp walks n8 column tiles down the blocks: X = Σ A_ik T_kj by 3xTF32 mma
     (A rows from s_a, T rows from s_t), X parked in T_ij's own place, then T_ij = -T_ii X. Column tile c
     costs Σ_{i > c//2} (2(i - c//2) + 2) k8 steps: 18, 18, 10, 10, 4, 4, 0, 0; warp w takes tile w and,
     for w >= 2, tile w + 2 (18, 18, 14, 14).
Blocks above the diagonal blocks are never written: nothing reads them (the W and U products stop at
the diagonal block).

Shared memory (float32 words, row stride AP ≡ 4 mod 32 for conflict-free A-fragment reads):
  s_a [BT, AP] at off_a: A, read only;  s_t [BT, AP] at off_t: T, written.
"""
from numba import float32, types, uint32

from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.mma_tf32 import make_a_split_ldmatrix, make_mma3_tiles, split_tf32
from ninfer_numba.kernels.numba_env import cuda

NB16 = BT // 16                  # 16-row blocks of a chunk


def make_tri_inverse(AP: int, off_a: int, off_t: int):
    """Device function ``tri_inverse(smem)`` for a block of 4 warps; ends after a block barrier."""
    if BT != 64:
        raise ValueError("the warp split of tri_inverse is laid out for 64-row chunks")
    load_a = make_a_split_ldmatrix(AP)
    mma3 = make_mma3_tiles(1)
    f0 = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def column_tile_down(smem, c, acc, bfr, gq, t):
        """Blocks i > c // 2 of n8 column tile c of T, top to bottom."""
        jb = c >> 1
        col = 8 * c + gq                         # B[t, g] reads: column g of the tile
        for i in range(jb + 1, NB16):
            for x in range(4):
                acc[x] = f0
            ra = uint32(off_a + 16 * i * AP)            # A[16i, 0]
            for ks in range(2 * jb, 2 * i):      # X = A[16i.., 16jb..16i) · T[16jb..16i), tile c]
                ah0, ah1, ah2, ah3, al0, al1, al2, al3 = load_a(smem, ra + uint32(8 * ks))
                bfr[0], bfr[2] = split_tf32(smem[uint32(off_t + (8 * ks + t) * AP + col)])
                bfr[1], bfr[3] = split_tf32(smem[uint32(off_t + (8 * ks + t + 4) * AP + col)])
                mma3(acc, 0, 0, 1, ah0, ah1, ah2, ah3, al0, al1, al2, al3, bfr)
            xp = uint32(off_t + (16 * i + gq) * AP + 8 * c + 2 * t)      # C[g, 2t] of T_ij's tile
            smem[xp] = acc[0]
            smem[xp + uint32(1)] = acc[1]
            smem[xp + uint32(8 * AP)] = acc[2]
            smem[xp + uint32(8 * AP + 1)] = acc[3]
            ptx.syncwarp()
            for x in range(4):
                acc[x] = f0
            rt = uint32(off_t + 16 * i * AP + 16 * i)   # T[16i, 16i]
            for ks in range(2):                  # T_ii · X
                ah0, ah1, ah2, ah3, al0, al1, al2, al3 = load_a(smem, rt + uint32(8 * ks))
                bfr[0], bfr[2] = split_tf32(smem[uint32(off_t + (16 * i + 8 * ks + t) * AP + col)])
                bfr[1], bfr[3] = split_tf32(smem[uint32(off_t + (16 * i + 8 * ks + t + 4) * AP + col)])
                mma3(acc, 0, 0, 1, ah0, ah1, ah2, ah3, al0, al1, al2, al3, bfr)
            ptx.syncwarp()                      # every lane has read X
            smem[xp] = -acc[0]
            smem[xp + uint32(1)] = -acc[1]
            smem[xp + uint32(8 * AP)] = -acc[2]
            smem[xp + uint32(8 * AP + 1)] = -acc[3]
            ptx.syncwarp()

    @cuda.jit(device=True, inline=True)
    def tri_inverse(smem):
        lane = cuda.threadIdx.x & 31
        w = cuda.threadIdx.x >> 5
        base = 16 * w
        if lane < 16:                            # a. T_ww column `lane` by substitution
            col = lane
            tc = uint32(off_t + base * AP + base + col)          # T[base, base + col]
            smem[tc + uint32(col * AP)] = float32(1.0)
            for i in range(col + 1, 16):         # T[i, col] = -Σ_{col <= m < i} A[i, m] T[m, col]
                ap = uint32(off_a + (base + i) * AP + base + col)
                tp = tc + uint32(col * AP)
                s = f0
                for _ in range(i - col):
                    s += smem[ap] * smem[tp]
                    ap += uint32(1)
                    tp += uint32(AP)
                smem[tc + uint32(i * AP)] = -s
        else:
            col = lane - 16
            for i in range(col):                 # above the diagonal inside the block
                smem[uint32(off_t + (base + i) * AP + base + col)] = f0
        cuda.syncthreads()
        acc = cuda.local.array(4, float32)       # [c0..c3] of one m16n8 tile
        bfr = cuda.local.array(4, types.uint32)  # [hi0, hi1, lo0, lo1] B fragment
        gq = lane >> 2
        t = lane & 3
        column_tile_down(smem, w, acc, bfr, gq, t)
        if w >= 2:
            column_tile_down(smem, w + 2, acc, bfr, gq, t)

    return tri_inverse
