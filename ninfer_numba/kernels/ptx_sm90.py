"""Hopper (sm_90a) inline-PTX intrinsics for the warpgroup GEMM, each with a pure-Python twin for the simulator.

On a GPU every name is an ``@intrinsic`` emitting PTX through ``llvmlite.ir.InlineAsm`` (as kernels/ptx.py):

- ``wgmma_rs_f16(n)`` -> ``wgmma(acc, a0, a1, a2, a3, smem, b_byte)``: one warpgroup-wide
  ``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16``, D = A·Bᵀ + D, with A (64 x 16 f16) in
  registers and B (n x 16 f16) in shared memory. ``acc`` is the UniTuple of n/2 float32 accumulators of this
  thread and is returned updated; a0..a3 are this thread's A fragment (uint32, two f16 each, low half
  first): a0 = A[r, 2q:2q+2], a1 = A[r+8, 2q:2q+2], a2 = A[r, 2q+8:2q+10], a3 = A[r+8, 2q+8:2q+10] with
  r = 16w + g. B is K-major (16 consecutive k per row) in the 128-byte-swizzled layout below, starting
  ``b_byte`` bytes past ``smem[0]``. Asynchronous: the accumulators may be read, and a0..a3's registers
  rewritten, only after ``wgmma_commit`` and a ``wgmma_wait_*`` that covers it.
- ``wgmma_fence()``, ``wgmma_commit()``, ``wgmma_wait_0()``, ``wgmma_wait_1()``: the warpgroup's
  ``wgmma.fence`` / ``commit_group`` / ``wait_group N`` (N groups may stay in flight).
- ``fence_proxy_async()``: ``fence.proxy.async.shared::cta``: shared memory this thread wrote with ordinary
  stores (or cp.async) becomes visible to the tensor cores' reads after the next barrier.
- ``acc_zero(n)`` -> ``zero()``: the UniTuple of n/2 float32 zeros.
- ``acc_store_t(n)`` -> ``store(acc, smem, byte, row_bytes)``: this thread's accumulators, transposed, into
  a float32 tile in shared memory whose rows are ``row_bytes`` apart: D[r, c] goes to row c, column r.
  ``byte`` is the address of this thread's first element, D[16w + g, 2q] (row 2q, column 16w + g).
- ``smem_u32(smem)``: the 32-bit shared-window address of ``smem[0]``.
- ``st_shared_v4(smem, byte, w0, w1, w2, w3)``: one 16-byte shared store at ``byte`` past ``smem[0]``.
- ``cp_async_16b(smem, byte, gmem, gi)``: 16-byte ``cp.async`` from flat element gi of a global array to
  ``byte`` past ``smem[0]`` (kernels/ptx.py's ``cp_async_16`` addresses shared memory by element and pays a
  generic-to-shared conversion per call; this one adds a byte offset to the array's shared address).
- ``ld_shared_v4_f32(smem, byte)`` -> four float32 from one 16-byte shared load (``ld_shared_v2_u32``: two
  uint32 from one 8-byte aligned load); ``st_global_v4_f32(arr, i,
  v0, v1, v2, v3)``: one 16-byte store at flat element i of a float32 global array (16-byte aligned).
- ``dequant_i8x4(word, scale2)``: four int8 (the bytes of ``word``, low first) times the f16 scale held
  twice in ``scale2`` -> two uint32 of two f16 each (elements 0, 1 and 2, 3, low half first). Exact int8 to
  f16 (``0x6400 | (b ^ 0x80)`` is the f16 1152 + b, then 1152 is subtracted), then one correctly rounded f16
  multiply: the result is float16(q · d), bit for bit what NumPy gives.

Accumulator layout of m64nNk16 (PTX ISA, "wgmma register fragments"): thread t of the warpgroup, w = t >> 5,
g = (t & 31) >> 2, q = t & 3; acc[4j + e] is D[16w + g + 8 (e >> 1), 8j + 2q + (e & 1)] for j < N/8.

Shared-memory layout of an operand (K-major, 128-byte swizzle, the descriptor's mode 1): rows of 64 f16
(128 bytes) one after another, tile base 1024-byte aligned; the 16-byte chunk c of row r is stored at chunk
c ^ (r & 7) of its row. One wgmma reads 16 k (32 bytes) of every row: its start address moves by 32 bytes per
k16 step; the descriptor's stride (8 rows = 1024 bytes) steps between 8-row groups.

Under ``NUMBA_ENABLE_CUDASIM=1`` the twins compute the same values: the ``wgmma`` twin gathers A from the
128 threads' fragments (kernels/ptx.py's lane exchange over a warpgroup), reads B from the shared bytes
through the same swizzle and returns this thread's fragment of A·Bᵀ; the asynchronous fences and waits do
nothing.
"""
import numpy as np
from llvmlite import ir
from numba import types

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.ptx import _element_address, asm_intrinsic, shared_address, void_intrinsic
from ninfer_numba.kernels.ptx_sim import _host_view, _warp_collective

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
SWIZZLE_ROW_BYTES = 128         # one row of the swizzled layout: 64 f16
SWIZZLE_ATOM_BYTES = 1024       # 8 rows: the swizzle pattern's period and the descriptor's stride
# descriptor bits other than the start address: leading offset 1 (unused when swizzled), stride 1024 B >> 4,
# swizzle mode 1 (128 B) in bits 62-63
_DESC_FIXED = (1 << 16) | ((SWIZZLE_ATOM_BYTES >> 4) << 32) | (1 << 62)


def swizzled_offset(row: int, chunk: int) -> int:
    """Byte offset of 16-byte chunk ``chunk`` (0..7) of row ``row`` in a swizzled tile (host-side helper)."""
    return row * SWIZZLE_ROW_BYTES + ((chunk ^ (row & 7)) << 4)


# ---------------------------------------------------------------- GPU: inline PTX ---------------------

def _smem_at(context, builder, sig, args, arr: int, byte: int):
    """32-bit shared-window address ``args[byte]`` bytes past element 0 of the shared array ``args[arr]``."""
    return builder.add(shared_address(context, builder, sig.args[arr], args[arr]),
                       context.cast(builder, args[byte], sig.args[byte], types.uint32))


def _make_intrinsics():
    from numba.cuda.extending import intrinsic

    wgmma_fence = void_intrinsic("wgmma.fence.sync.aligned;")
    wgmma_commit = void_intrinsic("wgmma.commit_group.sync.aligned;")
    wgmma_wait_0 = void_intrinsic("wgmma.wait_group.sync.aligned 0;")
    wgmma_wait_1 = void_intrinsic("wgmma.wait_group.sync.aligned 1;")
    fence_proxy_async = void_intrinsic("fence.proxy.async.shared::cta;")

    def wgmma_rs_f16(n):
        n_acc = n // 2
        regs = ", ".join(f"${i}" for i in range(n_acc))
        a_regs = ", ".join(f"${2 * n_acc + i}" for i in range(4))
        # scale-d is a predicate (true: D = A·B + D), set from a register holding 1
        asm = (f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${2 * n_acc + 5}, 0;\n"
               f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{regs}}}, {{{a_regs}}}, "
               f"${2 * n_acc + 4}, p, 1, 1, 0;\n}}")
        cons = ",".join(["=f"] * n_acc + [str(i) for i in range(n_acc)] + ["r"] * 4 + ["l", "r"])
        acc_ty = types.UniTuple(types.float32, n_acc)

        @intrinsic
        def wgmma(typingctx, acc, a0, a1, a2, a3, smem, b_byte):
            if acc != acc_ty:
                return None
            sig = acc_ty(acc, a0, a1, a2, a3, smem, b_byte)

            def codegen(context, builder, sig, args):
                addr = _smem_at(context, builder, sig, args, 5, 6)
                start = builder.and_(builder.lshr(addr, ir.Constant(_I32, 4)), ir.Constant(_I32, 0x3FFF))
                desc = builder.or_(builder.zext(start, _I64), ir.Constant(_I64, _DESC_FIXED))
                frag = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[1:5], sig.args[1:5])]
                ins = [builder.extract_value(args[0], i) for i in range(n_acc)]
                fn = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_F32] * n_acc),
                                                  [_F32] * n_acc + [_I32] * 4 + [_I64, _I32]),
                                  asm, cons + ",~{memory}", side_effect=True)
                res = builder.call(fn, ins + frag + [desc, ir.Constant(_I32, 1)])
                return context.make_tuple(builder, acc_ty, [builder.extract_value(res, i) for i in range(n_acc)])
            return sig, codegen
        return wgmma

    def acc_zero(n):
        acc_ty = types.UniTuple(types.float32, n // 2)

        @intrinsic
        def zero(typingctx):
            sig = acc_ty()

            def codegen(context, builder, sig, args):
                return context.make_tuple(builder, acc_ty, [ir.Constant(_F32, 0.0)] * (n // 2))
            return sig, codegen
        return zero

    def acc_store_t(n):
        acc_ty = types.UniTuple(types.float32, n // 2)
        st1 = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _F32]), "st.shared.f32 [$0], $1;",
                           "r,f,~{memory}", side_effect=True)

        @intrinsic
        def store(typingctx, acc, smem, byte, row_bytes):
            if acc != acc_ty:
                return None
            sig = types.void(acc, smem, byte, row_bytes)

            def codegen(context, builder, sig, args):
                base = _smem_at(context, builder, sig, args, 1, 2)
                row = context.cast(builder, args[3], sig.args[3], types.uint32)
                for i in range(n // 2):
                    j, e = i >> 2, i & 3
                    col = builder.mul(row, ir.Constant(_I32, 8 * j + (e & 1)))     # D column -> tile row
                    at = builder.add(builder.add(base, col), ir.Constant(_I32, 32 * (e >> 1)))
                    builder.call(st1, [at, builder.extract_value(args[0], i)])
                return context.get_dummy_value()
            return sig, codegen
        return store

    @intrinsic
    def smem_u32(typingctx, smem):
        sig = types.uint32(smem)

        def codegen(context, builder, sig, args):
            return shared_address(context, builder, sig.args[0], args[0])
        return sig, codegen

    def smem_and_u32s(context, builder, sig, args):       # (smem, byte, words...) -> shared address, words
        addr = _smem_at(context, builder, sig, args, 0, 1)
        return [addr] + [context.cast(builder, v, t, types.uint32) for v, t in zip(args[2:], sig.args[2:])]

    def smem_and_global(context, builder, sig, args):     # (smem, byte, gmem, gidx) -> both addresses
        return [_smem_at(context, builder, sig, args, 0, 1),
                _element_address(context, builder, sig.args[2], args[2], args[3], sig.args[3])]

    def global_and_f32s(context, builder, sig, args):     # (arr, idx, values...) -> address, float32 values
        addr = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return [addr] + [context.cast(builder, v, t, types.float32) for v, t in zip(args[2:], sig.args[2:])]

    def u32s(context, builder, sig, args):
        return [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]

    st_shared_v4 = asm_intrinsic(6, types.void, [_I32] * 5, "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
                                 "r,r,r,r,r,~{memory}", smem_and_u32s)
    cp_async_16b = asm_intrinsic(4, types.void, [_I32, _I64], "cp.async.cg.shared.global [$0], [$1], 16;",
                                 "r,l,~{memory}", smem_and_global)
    ld_shared_v4_f32 = asm_intrinsic(2, types.UniTuple(types.float32, 4), [_I32],
                                     "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r,~{memory}",
                                     smem_and_u32s, out_ir=[_F32] * 4)
    ld_shared_v2_u32 = asm_intrinsic(2, types.UniTuple(types.uint32, 2), [_I32], "ld.shared.v2.u32 {$0, $1}, [$2];",
                                     "=r,=r,r,~{memory}", smem_and_u32s, out_ir=[_I32] * 2)
    st_global_v4_f32 = asm_intrinsic(6, types.void, [_I64] + [_F32] * 4, "st.global.v4.f32 [$0], {$1, $2, $3, $4};",
                                     "l,f,f,f,f,~{memory}", global_and_f32s)
    # .rn on sub and mul keeps ptxas from contracting them into one fma (which would round differently)
    dequant_i8x4 = asm_intrinsic(2, types.UniTuple(types.uint32, 2), [_I32] * 2,
                                 "{\n.reg .b32 t, l, h, bias;\n"
                                 "mov.b32 bias, 0x64806480;\n"
                                 "xor.b32 t, $2, 0x80808080;\n"
                                 "prmt.b32 l, t, 0x64646464, 0x4140;\n"
                                 "prmt.b32 h, t, 0x64646464, 0x4342;\n"
                                 "sub.rn.f16x2 l, l, bias;\n"
                                 "sub.rn.f16x2 h, h, bias;\n"
                                 "mul.rn.f16x2 $0, l, $3;\n"
                                 "mul.rn.f16x2 $1, h, $3;\n}", "=r,=r,r,r", u32s, out_ir=[_I32] * 2,
                                 side_effect=False)

    return (wgmma_rs_f16, acc_zero, acc_store_t, wgmma_fence, wgmma_commit, wgmma_wait_0, wgmma_wait_1,
            fence_proxy_async, smem_u32, st_shared_v4, cp_async_16b, ld_shared_v4_f32,
            ld_shared_v2_u32, st_global_v4_f32, dequant_i8x4)


# ---------------------------------------------------------------- simulator: Python twins -------------

def _smem_bytes(smem):
    return _host_view(smem).reshape(-1).view(np.uint8)


def _shared_vector(smem, byte, nbytes: int, dtype):
    """The ``nbytes`` at ``byte`` of a simulated shared array as ``dtype`` (a vector load, aligned to its size)."""
    b = int(byte)
    if b % nbytes:
        raise ValueError(f"{nbytes}-byte shared load at byte offset {b} is misaligned")
    return _smem_bytes(smem)[b:b + nbytes].view(dtype)


def _read_swizzled(buf: np.ndarray, start: int, rows: int) -> np.ndarray:
    """[rows, 16] float64: 16 f16 of each row of a swizzled K-major tile from byte ``start`` (the descriptor's
    start address), swizzled on the address bits as the hardware does (bits 4-6 ^= bits 7-9)."""
    r = np.arange(rows)[:, None]
    logical = start + (r >> 3) * SWIZZLE_ATOM_BYTES + (r & 7) * SWIZZLE_ROW_BYTES + 2 * np.arange(16)[None, :]
    phys = logical ^ (((logical >> 7) & 7) << 4)
    lo = buf[phys].astype(np.uint16)
    hi = buf[phys + 1].astype(np.uint16)
    return (lo | (hi << 8)).view(np.float16).astype(np.float64)


def _fragment_index(n):
    """(rows, cols) of this simulated thread's n/2 accumulators in the 64 x n tile (module docstring)."""
    t = int(cuda.threadIdx.x) & 127
    w, g, q = t >> 5, (t & 31) >> 2, t & 3
    idx = np.arange(n // 2)
    return 16 * w + g + 8 * ((idx & 3) >> 1), 8 * (idx >> 2) + 2 * q + (idx & 1)


def _a_from_fragments(frags):
    """A [64, 16] float64 from the warpgroup's 128 (a0, a1, a2, a3) fragments (module docstring layout)."""
    f = np.array(frags, np.int64).astype(np.uint32).view(np.float16).reshape(128, 4, 2).astype(np.float64)
    t = np.arange(128)
    r = 16 * (t >> 5) + ((t & 31) >> 2)
    c = 2 * (t & 3)
    a = np.zeros((64, 16))
    for reg, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        a[r + dr, c + dc] = f[:, reg, 0]
        a[r + dr, c + dc + 1] = f[:, reg, 1]
    return a


def _make_fallbacks():
    @cuda.jit(device=True)
    def _noop():
        pass

    def wgmma_rs_f16(n):
        @cuda.jit(device=True)
        def wgmma(acc, a0, a1, a2, a3, smem, b_byte):
            _, a = _warp_collective(tuple(int(x) for x in (a0, a1, a2, a3)), _a_from_fragments, size=128)
            with np.errstate(invalid="ignore"):      # stale NaN bytes in tile rows whose outputs are unused
                d = a @ _read_swizzled(_smem_bytes(smem), int(b_byte), n).T
            rows, cols = _fragment_index(n)
            return tuple((np.asarray(acc, np.float64) + d[rows, cols]).astype(np.float32))
        return wgmma

    def acc_zero(n):
        @cuda.jit(device=True)
        def zero():
            return tuple(np.zeros(n // 2, np.float32))
        return zero

    def acc_store_t(n):
        @cuda.jit(device=True)
        def store(acc, smem, byte, row_bytes):
            f = _smem_bytes(smem)
            vals = np.asarray(acc, np.float32)
            for i in range(n // 2):
                j, e = i >> 2, i & 3
                at = int(byte) + (8 * j + (e & 1)) * int(row_bytes) + 32 * (e >> 1)
                f[at:at + 4] = vals[i:i + 1].view(np.uint8)
        return store

    @cuda.jit(device=True)
    def smem_u32(smem):
        return np.uint32(0)                       # twins address shared arrays by offset from element 0

    @cuda.jit(device=True)
    def st_shared_v4(smem, byte, w0, w1, w2, w3):
        b = int(byte)
        if b % 16:
            raise ValueError(f"16-byte shared store at byte offset {b} is misaligned")
        _smem_bytes(smem)[b:b + 16] = np.array([w0, w1, w2, w3], np.uint32).view(np.uint8)

    @cuda.jit(device=True)
    def cp_async_16b(smem, byte, gmem, gidx):
        a = _host_view(gmem).reshape(-1)
        start = int(gidx) * a.dtype.itemsize
        if start % 16 or int(byte) % 16:
            raise ValueError(f"cp.async at global byte {start} / shared byte {int(byte)} is misaligned")
        _smem_bytes(smem)[int(byte):int(byte) + 16] = a.view(np.uint8)[start:start + 16]

    @cuda.jit(device=True)
    def ld_shared_v4_f32(smem, byte):
        v = _shared_vector(smem, byte, 16, np.float32)
        return v[0], v[1], v[2], v[3]

    @cuda.jit(device=True)
    def ld_shared_v2_u32(smem, byte):
        v = _shared_vector(smem, byte, 8, np.uint32)
        return v[0], v[1]

    @cuda.jit(device=True)
    def st_global_v4_f32(arr, idx, v0, v1, v2, v3):
        a = _host_view(arr).reshape(-1)
        i = int(idx)
        if i % 4:
            raise ValueError(f"16-byte global store at element {i} is misaligned")
        a[i:i + 4] = (v0, v1, v2, v3)

    @cuda.jit(device=True)
    def dequant_i8x4(word, scale2):
        q = np.array([int(word) & 0xFFFFFFFF], np.uint32).view(np.int8).astype(np.float32)
        d = np.array([int(scale2) & 0xFFFF], np.uint16).view(np.float16).astype(np.float32)[0]
        with np.errstate(over="ignore"):
            h = (q * d).astype(np.float16).view(np.uint32)
        return np.uint32(h[0]), np.uint32(h[1])

    return (wgmma_rs_f16, acc_zero, acc_store_t, _noop, _noop, _noop, _noop, _noop, smem_u32, st_shared_v4,
            cp_async_16b, ld_shared_v4_f32, ld_shared_v2_u32, st_global_v4_f32, dequant_i8x4)


(wgmma_rs_f16, acc_zero, acc_store_t, wgmma_fence, wgmma_commit, wgmma_wait_0, wgmma_wait_1, fence_proxy_async,
 smem_u32, st_shared_v4, cp_async_16b, ld_shared_v4_f32, ld_shared_v2_u32, st_global_v4_f32, dequant_i8x4) = (
    _make_fallbacks() if SIMULATOR else _make_intrinsics())
