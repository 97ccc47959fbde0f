"""Inline-PTX intrinsics numba-cuda does not expose, each with a pure-Python twin for the CUDA simulator.

On a GPU every name below is an ``@intrinsic`` that emits one PTX instruction through
``llvmlite.ir.InlineAsm`` (pattern: reference/numba-cuda.md §2):

- ``dp4a(a, b, c)``: int32 c + dot of the four signed bytes of a and b (``dp4a.s32.s32``).
- ``ldg_nc_v4_u32(arr, i)``: 16-byte non-coherent load starting at flat element ``i`` of a C-contiguous
  array of any dtype and rank (e.g. 16 int8 of an int8 [N, K] weight, or uint32 ``arr[i:i+4]``), returned as
  four uint32 words; the address must be 16-byte aligned. Only for data no thread writes during the kernel.
  ``ldg_nc_v2_u32(arr, i)``: the same for 8 bytes (two words, 8-byte aligned).
- ``mma_s8_16832(a0..a3, b0, b1, c0..c3)``: warp-wide ``mma.sync.m16n8k32`` s8 x s8 -> s32.
- ``cp_async_16(smem, si, gmem, gi)``, ``cp_async_commit()``, ``cp_async_wait_all()``,
  ``cp_async_wait_1()``, ``cp_async_wait_2()``: 16-byte async copy from flat element gi of a global array to
  flat element si of a shared array (any dtypes, both addresses 16-byte aligned) and its group fences
  (wait_n: all but the newest n committed groups have landed).
- ``ldmatrix_x4(smem, i)``: warp-wide ``ldmatrix.sync.m8n8.x4.b16``: lane l supplies the 16-byte row at
  flat element i of a shared array, the row (l % 8) of matrix l // 8; lane l receives word l % 4 of row
  l // 4 of each of the four matrices (for int8 data: exactly the mma m16n8k32 A/B fragment layout).
  ``ldmatrix_x4_trans(smem, i)``: the same rows, each 8x8 b16 matrix transposed (lane (g, t) receives the
  pair M[2t, g], M[2t+1, g]).
- ``i32_as_f32(i)``: reinterpret the bits of an int32 as float32 (no conversion instruction).
- ``ex2_approx(x)``: 2^x as ``ex2.approx.ftz.f32`` (one MUFU; relative error ~2^-22, results below 2^-126
  flushed to 0, 2^-inf = 0). ``math.exp2`` compiles to libdevice's, which scales its input and squares
  its result around the MUFU to keep subnormal results: three more instructions a call.
- ``shfl_xor_i32(v, lane_mask)``, ``shfl_xor_f32(v, lane_mask)``, ``shfl_xor_f64(v, lane_mask)``: butterfly
  shuffle over the full warp (f64: two 32-bit shuffles);
  ``shfl_idx_f32(v, src_lane)``: every lane receives lane src_lane's v.
- ``vote_any(pred)``: True in every lane when pred is true in any lane of the full warp.
- ``syncwarp()``: ``bar.warp.sync`` over the full warp (shared-memory writes of each lane visible to all).
- ``griddep_wait()``, ``griddep_launch_dependents()``: ``griddepcontrol.wait`` / ``.launch_dependents``
  (programmatic dependent launch, kernels/pdl.py); nothing when compiling for a GPU before sm_90.

Under ``NUMBA_ENABLE_CUDASIM=1`` intrinsics cannot run, so the same names are bound to (ptx_sim.py)
``@cuda.jit(device=True)`` Python functions. Per-thread ops (dp4a, loads, copies) are plain indexing.
Warp-collective ops (shuffles, mma) exchange values between the 32 simulated threads of a warp through a
per-warp exchange point (ptx_sim._WarpRound); this relies on the simulator running a block's threads as
live Python threads (``BlockThread`` with ``_manager`` and ``thread_id``), so callers must use them with all 32 lanes
of a warp converged, exactly as the hardware requires, and with a block size that is a multiple of 32.
cp.async is synchronous there (commit/wait do nothing), which keeps any correctly fenced kernel correct.
"""
import inspect

from llvmlite import ir
from numba import types

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.ptx_sim import _make_fallbacks, install_simulator_patches   # the simulator's twins

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
FULL_MASK = 0xFFFFFFFF


# ---------------------------------------------------------------- GPU: inline PTX ---------------------

def _element_address(context, builder, aty, ary_val, idx_val, idx_ty):
    """Address of flat element idx of a C-contiguous array (any rank) as i64; no bounds or wraparound code."""
    ary = context.make_array(aty)(context, builder, value=ary_val)
    idx = context.cast(builder, idx_val, idx_ty, types.intp)
    return builder.ptrtoint(builder.gep(ary.data, [idx]), _I64)


_SHARED = 3                     # NVPTX address space of shared memory


def shared_address(context, builder, aty, ary_val, idx_val=None, idx_ty=None):
    """32-bit shared-window address of flat element idx (default 0) of a shared array.

    The array's data pointer is generic; an addrspacecast back to the shared space lets NVVM fold the cast
    into the shared global itself (32-bit address arithmetic, no cvta per call).
    """
    ary = context.make_array(aty)(context, builder, value=ary_val)
    ptr = ary.data
    if idx_val is not None:
        ptr = builder.gep(ptr, [context.cast(builder, idx_val, idx_ty, types.intp)])
    sptr = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, _SHARED))
    return builder.trunc(builder.ptrtoint(sptr, _I64), _I32)


def void_intrinsic(text: str):
    """An intrinsic taking nothing and returning nothing that emits ``text`` (a fence, a commit, a wait): a side
    effect with a memory clobber, so the compiler keeps it where it stands among memory accesses."""
    from numba.cuda.extending import intrinsic

    @intrinsic
    def op(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            return asm_void(context, builder, [], text, "~{memory}", [])
        return sig, codegen
    return op


def asm_void(context, builder, in_ir: list, asm: str, constraints: str, operands: list):
    """Emit inline PTX with no outputs and side effects (stores, copies, fences), and give back numba's
    void value: the codegen tail of every store-like intrinsic here."""
    fn = ir.InlineAsm(ir.FunctionType(ir.VoidType(), in_ir), asm, constraints, side_effect=True)
    builder.call(fn, operands)
    return context.get_dummy_value()


def asm_tuple(context, builder, ret, out_ir: list, in_ir: list, asm: str, constraints: str, operands: list,
              side_effect: bool = False):
    """Emit inline PTX with several outputs (LLVM types ``out_ir``, returned as a struct) and give them back
    as the numba tuple type ``ret``: the codegen tail of every multi-output intrinsic here."""
    fn = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType(out_ir), in_ir), asm, constraints,
                      side_effect=side_effect)
    res = builder.call(fn, operands)
    return context.make_tuple(builder, ret, [builder.extract_value(res, i) for i in range(len(out_ir))])


def asm_intrinsic(n_args: int, ret, in_ir: list, asm: str, constraints: str, operands, out_ir: list = (),
                  side_effect: bool = True):
    """An intrinsic of ``n_args`` arguments whose code is one inline-PTX statement. ``operands(context,
    builder, sig, args)`` gives the statement's input values (addresses, casts); ``ret`` is ``types.void``
    (a store or copy: asm_void) or a tuple type of the outputs ``out_ir`` (asm_tuple)."""
    from numba.cuda.extending import intrinsic

    def op(typingctx, *args):
        if len(args) != n_args:
            return None

        def codegen(context, builder, sig, args):
            vals = operands(context, builder, sig, args)
            if ret == types.void:
                return asm_void(context, builder, in_ir, asm, constraints, vals)
            return asm_tuple(context, builder, ret, out_ir, in_ir, asm, constraints, vals, side_effect)
        return ret(*args), codegen
    # numba lowers a call through the definition's Python signature, where *args would mean one tuple
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    op.__signature__ = inspect.Signature([inspect.Parameter(f"a{i}", positional) for i in range(n_args + 1)])
    return intrinsic(op)


def mma_sync_f32_intrinsic(shape_types: str):
    """An intrinsic ``mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)`` emitting
    ``mma.sync.aligned.<shape_types>`` with four b32 A registers, two b32 B registers and float32 C / D, e.g.
    shape_types ``"m16n8k16.row.col.f32.f16.f16.f32"`` or ``"m16n8k8.row.col.f32.tf32.tf32.f32"``."""
    from numba.cuda.extending import intrinsic
    asm = f"mma.sync.aligned.{shape_types} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, {{$10, $11, $12, $13}};"

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        ret = types.UniTuple(types.float32, 4)
        sig = ret(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            regs = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
            accs = [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
            return asm_tuple(context, builder, ret, [_F32] * 4, [_I32] * 6 + [_F32] * 4, asm,
                             ",".join(["=f"] * 4 + ["r"] * 6 + ["f"] * 4), regs + accs)
        return sig, codegen
    return mma


def pair_asm_intrinsic(asm: str, out_type):
    """An intrinsic ``f(x) -> (y0, y1)`` running ``asm`` on the 32 bits of x ($2; a float32 argument passes its
    bits) into two 32-bit results $0, $1 of ``out_type`` (types.uint32 or types.float32)."""
    from numba.cuda.extending import intrinsic
    out_ir, out_c = (_F32, "=f") if out_type == types.float32 else (_I32, "=r")

    @intrinsic
    def pair(typingctx, x):
        ret = types.UniTuple(out_type, 2)
        sig = ret(x)

        def codegen(context, builder, sig, args):
            if isinstance(sig.args[0], types.Float):
                word = builder.bitcast(context.cast(builder, args[0], sig.args[0], types.float32), _I32)
            else:
                word = context.cast(builder, args[0], sig.args[0], types.uint32)
            return asm_tuple(context, builder, ret, [out_ir] * 2, [_I32], asm, f"{out_c},{out_c},r", [word])
        return sig, codegen
    return pair


def _make_intrinsics():
    from numba.cuda.extending import intrinsic

    @intrinsic
    def dp4a(typingctx, a, b, c):
        sig = types.int32(a, b, c)

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args)]
            fn = ir.InlineAsm(ir.FunctionType(_I32, [_I32] * 3), "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(fn, vals)
        return sig, codegen

    def ldg_nc_u32(n):
        asm = (f"ld.global.nc.v{n}.u32 {{{', '.join(f'${i}' for i in range(n))}}}, [${n}];")

        @intrinsic
        def ldg(typingctx, arr, idx):
            ret = types.UniTuple(types.uint32, n)
            sig = ret(arr, idx)

            def codegen(context, builder, sig, args):
                addr = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                return asm_tuple(context, builder, ret, [_I32] * n, [_I64], asm, ",".join(["=r"] * n + ["l"]), [addr])
            return sig, codegen
        return ldg

    ldg_nc_v4_u32 = ldg_nc_u32(4)
    ldg_nc_v2_u32 = ldg_nc_u32(2)

    @intrinsic
    def mma_s8_16832(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        ret = types.UniTuple(types.int32, 4)
        sig = ret(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args)]
            asm = ("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                   "{$8, $9}, {$10, $11, $12, $13};")
            return asm_tuple(context, builder, ret, [_I32] * 4, [_I32] * 10, asm,
                             ",".join(["=r"] * 4 + ["r"] * 10), vals)
        return sig, codegen

    @intrinsic
    def cp_async_16(typingctx, smem, sidx, gmem, gidx):
        sig = types.void(smem, sidx, gmem, gidx)

        def codegen(context, builder, sig, args):
            s_generic = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            g_addr = _element_address(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            # cp.async wants a 32-bit shared-window address: convert the generic pointer, then truncate
            to_shared = ir.InlineAsm(ir.FunctionType(_I64, [_I64]), "cvta.to.shared.u64 $0, $1;", "=l,l")
            s_addr = builder.trunc(builder.call(to_shared, [s_generic]), _I32)
            return asm_void(context, builder, [_I32, _I64], "cp.async.cg.shared.global [$0], [$1], 16;",
                            "r,l,~{memory}", [s_addr, g_addr])
        return sig, codegen

    cp_async_commit = void_intrinsic("cp.async.commit_group;")
    cp_async_wait_all = void_intrinsic("cp.async.wait_group 0;")
    cp_async_wait_1 = void_intrinsic("cp.async.wait_group 1;")
    cp_async_wait_2 = void_intrinsic("cp.async.wait_group 2;")

    def _ldmatrix(trans):
        asm = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") +
               ".shared.b16 {$0, $1, $2, $3}, [$4];")

        @intrinsic
        def ldmatrix(typingctx, smem, idx):
            ret = types.UniTuple(types.uint32, 4)
            sig = ret(smem, idx)

            def codegen(context, builder, sig, args):
                addr = shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                # a memory read the compiler cannot see: side effect + memory clobber keep it after the
                # barrier and the cp.async wait that make the tile visible
                return asm_tuple(context, builder, ret, [_I32] * 4, [_I32], asm, "=r,=r,=r,=r,r,~{memory}",
                                 [addr], side_effect=True)
            return sig, codegen
        return ldmatrix

    ldmatrix_x4, ldmatrix_x4_trans = _ldmatrix(False), _ldmatrix(True)

    @intrinsic
    def i32_as_f32(typingctx, i):
        sig = types.float32(i)

        def codegen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.int32), _F32)
        return sig, codegen

    @intrinsic
    def ex2_approx(typingctx, x):
        sig = types.float32(x)

        def codegen(context, builder, sig, args):
            fn = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f")
            return builder.call(fn, [context.cast(builder, args[0], sig.args[0], types.float32)])
        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def shfl_xor_i32(v, lane_mask):
        return cuda.shfl_xor_sync(FULL_MASK, v, lane_mask)

    @cuda.jit(device=True, inline=True)
    def shfl_xor_f32(v, lane_mask):
        return cuda.shfl_xor_sync(FULL_MASK, v, lane_mask)

    @cuda.jit(device=True, inline=True)
    def shfl_xor_f64(v, lane_mask):
        return cuda.shfl_xor_sync(FULL_MASK, v, lane_mask)

    @cuda.jit(device=True, inline=True)
    def shfl_idx_f32(v, src_lane):
        return cuda.shfl_sync(FULL_MASK, v, src_lane)

    @cuda.jit(device=True, inline=True)
    def vote_any(pred):
        return cuda.any_sync(FULL_MASK, pred)

    @cuda.jit(device=True, inline=True)
    def syncwarp():
        cuda.syncwarp(FULL_MASK)

    def griddep(asm: str):
        """A griddepcontrol instruction (kernels/pdl.py); nothing when compiling for a GPU before sm_90."""
        @intrinsic
        def call(typingctx):
            def codegen(context, builder, sig, args):
                if tuple(cuda.get_current_device().compute_capability) >= (9, 0):
                    return asm_void(context, builder, [], asm, "~{memory}", [])
                return context.get_dummy_value()
            return types.void(), codegen
        return call

    return (dp4a, ldg_nc_v4_u32, ldg_nc_v2_u32, mma_s8_16832, cp_async_16, cp_async_commit, cp_async_wait_all,
            cp_async_wait_1, ldmatrix_x4, ldmatrix_x4_trans, i32_as_f32, shfl_xor_i32, shfl_xor_f32, shfl_xor_f64,
            shfl_idx_f32, syncwarp, griddep("griddepcontrol.wait;"), griddep("griddepcontrol.launch_dependents;"),
            cp_async_wait_2, vote_any, ex2_approx)


if SIMULATOR:
    install_simulator_patches()

(dp4a, ldg_nc_v4_u32, ldg_nc_v2_u32, mma_s8_16832, cp_async_16, cp_async_commit, cp_async_wait_all,
 cp_async_wait_1, ldmatrix_x4, ldmatrix_x4_trans, i32_as_f32, shfl_xor_i32, shfl_xor_f32, shfl_xor_f64,
 shfl_idx_f32, syncwarp, griddep_wait, griddep_launch_dependents, cp_async_wait_2, vote_any, ex2_approx) = (
    _make_fallbacks() if SIMULATOR else _make_intrinsics())
