"""Inline-PTX intrinsics (ptx.py) against NumPy: the PTX on a GPU, the Python twins under the simulator.

Every check is exact (integer ops, bit moves, data movement). Run under the simulator with
``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim tests/kernels/test_ptx.py``; on a GPU the same tests run the PTX.
"""
import numpy as np
import pytest
from numba import uint32

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels import ptx, ptx_sm90

pytestmark = [pytest.mark.cudasim,
              pytest.mark.skipif(not (SIMULATOR or gpu_available()), reason="needs the CUDA simulator or a GPU")]


def test_trivial_kernel_compiles_and_runs():
    """The numpy row_stack shim in numba_env lets a kernel compile and launch."""
    @cuda.jit
    def add_one(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1

    a = np.arange(37, dtype=np.int32)
    d = cuda.to_device(a)
    add_one[1, 64](d)
    np.testing.assert_array_equal(d.copy_to_host(), a + 1)


@cuda.jit
def _dp4a_kernel(a, b, c, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = ptx.dp4a(a[i], b[i], c[i])


def test_dp4a_matches_int8_dot():
    rng = np.random.default_rng(0)
    n = 45
    a = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    b = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    a[:3] = [-1, 0x7F7F7F7F, np.int32(-0x7F7F7F80)]            # all -1 bytes, all +127, all -128
    b[:3] = [-1, 0x7F7F7F7F, np.int32(-0x7F7F7F80)]
    c = rng.integers(-10**6, 10**6, n).astype(np.int32)
    ref = (a.view(np.int8).reshape(n, 4).astype(np.int64) * b.view(np.int8).reshape(n, 4)).sum(1) + c
    out = cuda.to_device(np.full(n, -7, np.int32))
    _dp4a_kernel[1, 64](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), out)
    np.testing.assert_array_equal(out.copy_to_host(), ref.astype(np.int32))


@cuda.jit
def _ldg_kernel(src, out):
    i = cuda.grid(1) * 4
    if i < src.size:
        x, y, z, w = ptx.ldg_nc_v4_u32(src, i)
        out[i], out[i + 1], out[i + 2], out[i + 3] = x, y, z, w


def test_ldg_nc_v4_u32_copies():
    rng = np.random.default_rng(1)
    src = rng.integers(0, 2**32, 4 * 13, dtype=np.uint64).astype(np.uint32)
    out = cuda.to_device(np.zeros_like(src))
    _ldg_kernel[1, 32](cuda.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), src)


@cuda.jit
def _ldg_int8_rows_kernel(w, out):
    """w: [R, C] int8 (C % 16 == 0) -> out: [R * C / 4] uint32, read 16 bytes per thread by flat index."""
    i = cuda.grid(1) * 16
    if i < w.size:
        x, y, z, v = ptx.ldg_nc_v4_u32(w, i)
        j = i // 4
        out[j], out[j + 1], out[j + 2], out[j + 3] = x, y, z, v


def test_ldg_nc_v4_u32_on_int8_matrix():
    """Flat element indexing of a 2-D int8 array: the weight layout the GEMV reads."""
    rng = np.random.default_rng(5)
    w = rng.integers(-128, 128, (3, 96), dtype=np.int8)
    out = cuda.to_device(np.zeros(3 * 96 // 4, np.uint32))
    _ldg_int8_rows_kernel[1, 32](cuda.to_device(w), out)
    np.testing.assert_array_equal(out.copy_to_host(), w.reshape(-1).view(np.uint32))


def _elementwise(op):
    """A kernel writing out[i] = op(x[i]) for every element of x (a per-thread intrinsic)."""
    @cuda.jit
    def kernel(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = op(x[i])
    return kernel


_bits_kernel = _elementwise(ptx.i32_as_f32)
_ex2_kernel = _elementwise(ptx.ex2_approx)


def test_i32_as_f32_reinterprets_bits():
    ints = np.array([0, 1, -1, 0x4B400000, 0x4B400000 + 12345, 0x3F800000], np.int32)
    out = cuda.to_device(np.zeros(ints.size, np.float32))
    _bits_kernel[1, 32](cuda.to_device(ints), out)
    np.testing.assert_array_equal(out.copy_to_host().view(np.int32), ints)


@cuda.jit
def _shfl_kernel(vi, vf, out_i, out_f):
    lane = cuda.threadIdx.x
    r = 0
    for m in (1, 2, 16):                      # record three butterfly partners per lane
        out_i[r * 32 + lane] = ptx.shfl_xor_i32(vi[lane], m)
        out_f[r * 32 + lane] = ptx.shfl_xor_f32(vf[lane], m)
        r += 1


def test_shfl_xor_butterfly():
    rng = np.random.default_rng(2)
    vi = rng.integers(-1000, 1000, 32).astype(np.int32)
    vf = rng.standard_normal(32).astype(np.float32)
    oi, of = cuda.to_device(np.zeros(96, np.int32)), cuda.to_device(np.zeros(96, np.float32))
    _shfl_kernel[1, 32](cuda.to_device(vi), cuda.to_device(vf), oi, of)
    lanes = np.arange(32)
    ref_i = np.concatenate([vi[lanes ^ m] for m in (1, 2, 16)])
    ref_f = np.concatenate([vf[lanes ^ m] for m in (1, 2, 16)])
    np.testing.assert_array_equal(oi.copy_to_host(), ref_i)
    np.testing.assert_array_equal(of.copy_to_host(), ref_f)


@cuda.jit
def _mma_kernel(a_words, b_words, c, d):
    """a_words: [16, 8] uint32 (A 16x32 int8 row-major), b_words: [8, 8] uint32 (B^T: 8 rows of 32 k)."""
    lane = cuda.threadIdx.x
    g, t = lane >> 2, lane & 3
    d0, d1, d2, d3 = ptx.mma_s8_16832(
        a_words[g, t], a_words[g + 8, t], a_words[g, t + 4], a_words[g + 8, t + 4],
        b_words[g, t], b_words[g, t + 4],
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = d0, d1, d2, d3


def test_mma_s8_16832_matches_int_matmul():
    rng = np.random.default_rng(3)
    a = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    bt = rng.integers(-128, 128, (8, 32)).astype(np.int8)     # B column-major = B^T row-major
    a[0], bt[0] = -128, -128                                  # extreme products
    c = rng.integers(-10**5, 10**5, (16, 8)).astype(np.int32)
    ref = a.astype(np.int64) @ bt.astype(np.int64).T + c
    d = cuda.to_device(np.zeros((16, 8), np.int32))
    _mma_kernel[1, 32](cuda.to_device(a.view(np.uint32)), cuda.to_device(bt.view(np.uint32)),
                       cuda.to_device(c), d)
    np.testing.assert_array_equal(d.copy_to_host(), ref.astype(np.int32))


@cuda.jit
def _cp_async_kernel(src, out):
    s_buf = cuda.shared.array(256, dtype=np.uint32, alignment=16)   # [64 chunks * 4] uint32
    t = cuda.threadIdx.x
    ptx.cp_async_16(s_buf, t * 4, src, (63 - t) * 4)                # reversed chunk order
    ptx.cp_async_commit()
    ptx.cp_async_wait_all()
    cuda.syncthreads()
    for j in range(4):
        out[t * 4 + j] = s_buf[((t + 1) % 64) * 4 + j]              # read another thread's chunk


@cuda.jit
def _cp_async_int8_kernel(src, out):
    """src: [4, 64] int8 -> out: [64] uint32 through a 2-D shared array [4, 16] of uint32."""
    s_buf = cuda.shared.array((4, 16), dtype=np.uint32, alignment=16)
    t = cuda.threadIdx.x                                            # 16 threads, one 16-byte chunk each
    ptx.cp_async_16(s_buf, t * 4, src, t * 16)
    ptx.cp_async_commit()
    ptx.cp_async_wait_all()
    cuda.syncthreads()
    for j in range(4):
        out[t * 4 + j] = s_buf[t // 4, (t % 4) * 4 + j]


def test_cp_async_16_int8_source_2d_shared():
    rng = np.random.default_rng(6)
    src = rng.integers(-128, 128, (4, 64), dtype=np.int8)
    out = cuda.to_device(np.zeros(64, np.uint32))
    _cp_async_int8_kernel[1, 16](cuda.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), src.reshape(-1).view(np.uint32))


def test_cp_async_16_global_to_shared():
    rng = np.random.default_rng(4)
    src = rng.integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32)
    out = cuda.to_device(np.zeros(256, np.uint32))
    _cp_async_kernel[1, 64](cuda.to_device(src), out)
    chunks = src.reshape(64, 4)[::-1]
    np.testing.assert_array_equal(out.copy_to_host().reshape(64, 4), np.roll(chunks, -1, axis=0))


@cuda.jit
def _cp_async_groups_kernel(src, out):
    """src: [3, 32, 4] uint32; thread l copies its 16 bytes of each of 3 parts as 3 groups, then reads part 0
    after wait_group 2 (the oldest group) and parts 1, 2 after wait_group 0, each as two 8-byte shared loads
    of another lane's words; out: [3, 32, 4]."""
    ring = cuda.shared.array(0, uint32, alignment=16)       # [3, 32, 4]
    lane = cuda.threadIdx.x
    for part in range(3):
        ptx_sm90.cp_async_16b(ring, 16 * (32 * part + lane), src, 4 * (32 * part + lane))
        ptx.cp_async_commit()
    ptx.cp_async_wait_2()
    cuda.syncthreads()
    other = 31 - lane
    out[0, lane, 0], out[0, lane, 1] = ptx_sm90.ld_shared_v2_u32(ring, 16 * other)
    out[0, lane, 2], out[0, lane, 3] = ptx_sm90.ld_shared_v2_u32(ring, 16 * other + 8)
    ptx.cp_async_wait_all()
    cuda.syncthreads()
    for part in range(1, 3):
        at = 16 * (32 * part + other)
        out[part, lane, 0], out[part, lane, 1] = ptx_sm90.ld_shared_v2_u32(ring, at)
        out[part, lane, 2], out[part, lane, 3] = ptx_sm90.ld_shared_v2_u32(ring, at + 8)


def test_cp_async_groups_and_8_byte_shared_loads():
    rng = np.random.default_rng(9)
    src = rng.integers(0, 2**32, (3, 32, 4), dtype=np.uint64).astype(np.uint32)
    out = cuda.to_device(np.zeros((3, 32, 4), np.uint32))
    _cp_async_groups_kernel[1, 32, 0, 3 * 32 * 16](cuda.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), src[:, ::-1])


def test_ex2_approx_is_exp2_with_subnormals_flushed():
    """2^x to ~2^-22 relative (the one MUFU, no range scaling): 2^-inf is 0, results below 2^-126 are 0."""
    x = np.array([-np.inf, -300, -127.5, -125.5, -30.25, -1.5, -1e-3, 0, 0.3, 7.75, 100], np.float32)
    out = cuda.to_device(np.zeros(x.size, np.float32))
    _ex2_kernel[1, 32](cuda.to_device(x), out)
    got = out.copy_to_host()
    want = np.exp2(x.astype(np.float64))
    want[want < 2.0 ** -126] = 0
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert got[0] == 0 and got[2] == 0 and got[3] > 0


@cuda.jit
def _ldmatrix_kernel(src, row_of_lane, out):
    """src: [32, 4] uint32 rows; lane l points ldmatrix at row row_of_lane[l]; out: [32, 4] results."""
    s_rows = cuda.shared.array((32, 4), dtype=np.uint32, alignment=16)
    lane = cuda.threadIdx.x
    for j in range(4):
        s_rows[lane, j] = src[lane, j]
    cuda.syncthreads()
    r0, r1, r2, r3 = ptx.ldmatrix_x4(s_rows, row_of_lane[lane] * 4)
    out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = r0, r1, r2, r3


def test_ldmatrix_x4_fragment_layout():
    """Lane l gets word l % 4 of the row that lane 8 j + l // 4 pointed at, for matrices j = 0..3."""
    rng = np.random.default_rng(7)
    src = rng.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32)
    row_of_lane = rng.permutation(32).astype(np.int32)
    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    _ldmatrix_kernel[1, 32](cuda.to_device(src), cuda.to_device(row_of_lane), out)
    lanes = np.arange(32)
    ref = np.stack([src[row_of_lane[8 * j + lanes // 4], lanes % 4] for j in range(4)], axis=1)
    np.testing.assert_array_equal(out.copy_to_host(), ref)


def _float_mma_registers(a, b, per_reg, pack):
    """[32, 6] uint32: lane (g, t)'s a0..a3, b0, b1 of an m16n8k(8·per_reg) mma (the PTX ISA's layout)."""
    half = 4 * per_reg
    regs = np.zeros((32, 6), np.uint32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        cols = [per_reg * t + i for i in range(per_reg)]
        blocks = [a[g, cols], a[g + 8, cols], a[g, [c + half for c in cols]], a[g + 8, [c + half for c in cols]],
                  b[cols, g], b[[c + half for c in cols], g]]
        regs[lane] = [pack(x) for x in blocks]
    return regs


def _float_mma_kernel(mma):
    @cuda.jit
    def kernel(regs, c, d):
        """regs: [32, 6] uint32, c, d: [16, 8] float32; one warp."""
        lane = cuda.threadIdx.x
        g, t = lane >> 2, lane & 3
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = mma(
            regs[lane, 0], regs[lane, 1], regs[lane, 2], regs[lane, 3], regs[lane, 4], regs[lane, 5],
            c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    return kernel


@pytest.mark.parametrize("kind", ["tf32_1688", "f16_16816"])
def test_float_mma_matches_matmul(kind):
    """Operands exactly representable in the input type, so A·B + C is exact in float64 up to the float32
    accumulator's rounding."""
    from ninfer_numba.kernels.flash_attn.mma_f16 import mma_f16_16816
    from ninfer_numba.kernels.mma_tf32 import mma_tf32_1688
    rng = np.random.default_rng(11)
    per_reg, mma = (1, mma_tf32_1688) if kind == "tf32_1688" else (2, mma_f16_16816)
    k = 8 * per_reg
    a = rng.integers(-64, 64, (16, k)) / 16.0
    b = rng.integers(-64, 64, (k, 8)) / 8.0
    c = (rng.integers(-64, 64, (16, 8)) / 4.0).astype(np.float32)
    if per_reg == 1:
        pack = lambda x: np.float32(x[0]).view(np.uint32)
    else:
        pack = lambda x: np.array(x, np.float16).view(np.uint32)[0]
    regs = _float_mma_registers(a, b, per_reg, pack)
    d = cuda.to_device(np.zeros((16, 8), np.float32))
    _float_mma_kernel(mma)[1, 32](cuda.to_device(regs), cuda.to_device(c), d)
    np.testing.assert_array_equal(d.copy_to_host(), (a @ b + c).astype(np.float32))


@cuda.jit
def _barrier_order_kernel(out):
    """Every thread writes its slot, waits at the barrier, then reads a neighbour's: the read sees the write
    only if no thread leaves syncthreads() before all arrived. Three rounds, some threads exiting early."""
    s = cuda.shared.array(96, np.int32)
    tid = cuda.threadIdx.x
    for r in range(3):
        s[tid] = 10 * r + tid
        cuda.syncthreads()
        out[r, tid] = s[(tid + 1) % 96]
        cuda.syncthreads()
    if tid >= 64:
        return
    s[tid] = -1
    cuda.syncthreads()                    # only the 64 live threads arrive: released all the same
    out[3, tid] = s[(tid + 1) % 64]


def test_syncthreads_orders_all_threads_and_tolerates_exits():
    out = cuda.to_device(np.zeros((4, 96), np.int32))
    _barrier_order_kernel[2, 96](out)
    tid = np.arange(96)
    expect = np.stack([10 * r + (tid + 1) % 96 for r in range(3)] + [np.where(tid < 64, -1, 0)])
    np.testing.assert_array_equal(out.copy_to_host(), expect)


@cuda.jit
def _raising_kernel(a):
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    a[tid + 40] = 1                        # out of range for the threads >= 24: IndexError in the simulator


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's error path")
def test_simulator_reraises_a_thread_error_without_hanging():
    with pytest.raises(IndexError):
        _raising_kernel[1, 64](cuda.to_device(np.zeros(64, np.int32)))


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's block manager")
def test_simulator_runs_blocks_without_the_busy_poll():
    """The stock manager's busy loop made the simulator suite 5-10 times slower (CI ran past its limit)."""
    from numba.cuda.simulator import kernel
    from ninfer_numba.kernels import ptx_sim
    assert kernel.BlockManager.run is ptx_sim._block_manager_run
