"""The simulator's twins of kernels/ptx.py's intrinsics: pure-Python ``@cuda.jit(device=True)`` functions bound to
the same names under ``NUMBA_ENABLE_CUDASIM=1`` (ptx.py's docstring says how warp-collective ops exchange
values between the simulated threads), and the shared-array alignment the simulator would otherwise reject.
"""
import sys
import threading
import time
import traceback

import numpy as np
from numba import types
from numba.np import numpy_support

from ninfer_numba.kernels.numba_env import cuda


_WARP_LOCK = threading.Lock()
_WARP_TIMEOUT_S = 120.0  # a lane that never arrives (diverged warp, crashed thread) fails instead of hanging


class _WarpRound:
    """One exchange point of a simulated warp: ``size`` lanes deposit values; the last to arrive runs
    ``combine`` on them and publishes the result; then all are released. One wake-up round per exchange:
    the simulator's cost is the threads' hand-offs (two ``threading.Barrier`` waits per exchange cost 1.5-3
    times as much in the GDN kernels' tests)."""

    def __init__(self, size: int) -> None:
        self.size, self.arrived, self.generation = size, 0, 0
        self.values, self.result = [None] * size, None
        self.cond = threading.Condition(threading.Lock())

    def exchange(self, lane: int, value, combine):
        with self.cond:
            self.values[lane] = value
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.size:
                # Safe to overwrite: every lane read the previous result before it could arrive here.
                self.result = combine(self.values)
                self.arrived, self.generation = 0, generation + 1
                self.cond.notify_all()
                return self.result
            if not self.cond.wait_for(lambda: self.generation != generation, _WARP_TIMEOUT_S):
                raise RuntimeError(f"simulated warp: lane {lane} waited {_WARP_TIMEOUT_S:.0f} s for the "
                                   f"others (a diverged warp-collective call?)")
            return self.result


def _warp_collective(value, combine, size=32):
    """Exchange among the ``size`` simulated threads of the calling warp (or, with size=128, warpgroup).

    Every thread deposits ``value``; the last to arrive computes ``combine(list of size values)`` once;
    every thread gets (its index in the group, that result).
    """
    me = threading.current_thread()
    manager, tid = me._manager, me.thread_id
    with _WARP_LOCK:
        table = manager.__dict__.setdefault("_ninfer_warps", {})
        slot = table.get((size, tid // size))
        if slot is None:
            slot = table[(size, tid // size)] = _WarpRound(size)
    lane = tid % size
    return lane, slot.exchange(lane, value, combine)


_LANES = np.arange(32)
_FRAG_ROW = (_LANES >> 2)[:, None]                              # g for each lane, as a column
_FRAG_COL = (4 * (_LANES & 3))[:, None] + np.arange(4)[None, :]  # 4t + e


def _mma_from_fragments(frags):
    """D = A @ B (int64 [16, 8]) from the 32 lanes' (a0, a1, a2, a3, b0, b1) in the PTX ISA m16n8k32 layout:
    a0 = A[g, 4t:4t+4], a1 = A[g+8, 4t:4t+4], a2 = A[g, 4t+16:4t+20], a3 = A[g+8, 4t+16:4t+20],
    b0 = B[4t:4t+4, g], b1 = B[4t+16:4t+20, g], with g = lane >> 2, t = lane & 3."""
    by = np.array(frags, dtype=np.int64).astype(np.uint32).view(np.int8).reshape(32, 6, 4).astype(np.int64)
    a = np.zeros((16, 32), np.int64)
    b = np.zeros((32, 8), np.int64)
    a[_FRAG_ROW, _FRAG_COL] = by[:, 0]
    a[_FRAG_ROW + 8, _FRAG_COL] = by[:, 1]
    a[_FRAG_ROW, _FRAG_COL + 16] = by[:, 2]
    a[_FRAG_ROW + 8, _FRAG_COL + 16] = by[:, 3]
    b[_FRAG_COL, _FRAG_ROW] = by[:, 4]
    b[_FRAG_COL + 16, _FRAG_ROW] = by[:, 5]
    return a @ b


def _host_view(arr):
    """The numpy array behind a simulator kernel argument (shared and local arrays are numpy already)."""
    item = getattr(arr, "_item", None)
    return arr if item is None else item._ary


def _sim_bytes16(arr, idx, n=16):
    """The n (16) bytes starting at flat element idx of a C-contiguous array, as a writable uint8 view."""
    a = _host_view(arr)
    start = int(idx) * a.dtype.itemsize
    if start % n:
        raise ValueError(f"{n}-byte access at byte offset {start} is misaligned")
    return a.reshape(-1).view(np.uint8)[start:start + n]


def _wrap_s32(v):
    """Two's-complement int32 wrap, like the hardware's s32 accumulate."""
    return ((int(v) + 2**31) % 2**32) - 2**31


def _sim_dp4a(a, b, c):
    s = int(c)
    a, b = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF
    for shift in (0, 8, 16, 24):
        x, y = (a >> shift) & 0xFF, (b >> shift) & 0xFF
        s += (x - 256 if x > 127 else x) * (y - 256 if y > 127 else y)
    return _wrap_s32(s)


def _ldmatrix_regs(rows, trans):
    """The four registers of every lane (uint32 [32, 4]) from the 32 lanes' 16-byte rows (uint32 [32, 4]
    each): matrix m is rows 8m..8m+7. Plain: lane (g, t) gets word t of row g, i.e. M[g, 2t:2t+2] in b16;
    .trans: the pair (M[2t, g], M[2t+1, g])."""
    rows = np.asarray(rows, np.uint32).reshape(32, 4)
    g, t = _LANES >> 2, _LANES & 3
    out = np.zeros((32, 4), np.uint32)
    for m in range(4):
        mat = rows[8 * m:8 * m + 8]
        if not trans:
            out[:, m] = mat[g, t]
        else:
            halves = mat.view(np.uint16)                        # [8 rows, 8 columns]
            out[:, m] = halves[2 * t, g].astype(np.uint32) | (halves[2 * t + 1, g].astype(np.uint32) << 16)
    return out


def _ldmatrix_plain(rows):
    return _ldmatrix_regs(rows, False)


def _ldmatrix_trans(rows):
    return _ldmatrix_regs(rows, True)


def _mma_operands_product(frags, decode, per_reg: int):
    """A·B (float64 [16, 8]) of an m16n8k(8·per_reg) mma from the 32 lanes' (a0, a1, a2, a3, b0, b1): lane
    (g, t) = (lane // 4, lane % 4) holds A[g (+8), per_reg·t + i (+4·per_reg)] and B[per_reg·t + i (+4·per_reg),
    g] for i < per_reg; ``decode`` maps 32 register words to their per_reg values each."""
    f = np.array(frags, np.int64)
    lanes = np.arange(32)
    rows = (lanes >> 2)[:, None]
    cols = per_reg * (lanes & 3)[:, None] + np.arange(per_reg)[None, :]
    half = 4 * per_reg
    a = np.zeros((16, 2 * half))
    b = np.zeros((2 * half, 8))
    vals = [np.asarray(decode(f[:, r])).reshape(32, per_reg) for r in range(6)]
    a[rows, cols], a[rows + 8, cols], a[rows, cols + half], a[rows + 8, cols + half] = vals[:4]
    b[cols, rows], b[cols + half, rows] = vals[4:]
    return a @ b


def mma_sync_f32_twin(decode, per_reg: int):
    """The simulator's stand-in for an intrinsic of ``mma_sync_f32_intrinsic`` whose operand registers hold
    per_reg values each (``decode``: 32 words -> their values); each lane gets its C/D fragment plus c."""
    def product(frags):
        return _mma_operands_product(frags, decode, per_reg)

    @cuda.jit(device=True)
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lane, d = _warp_collective(tuple(int(x) for x in (a0, a1, a2, a3, b0, b1)), product)
        g, t = lane >> 2, lane & 3
        return (np.float32(d[g, 2 * t] + c0), np.float32(d[g, 2 * t + 1] + c1),
                np.float32(d[g + 8, 2 * t] + c2), np.float32(d[g + 8, 2 * t + 1] + c3))
    return mma


def _make_fallbacks():
    @cuda.jit(device=True)
    def dp4a(a, b, c):
        return np.int32(_sim_dp4a(a, b, c))

    @cuda.jit(device=True)
    def ldg_nc_v4_u32(arr, idx):
        w = _sim_bytes16(arr, idx).view(np.uint32)
        return w[0], w[1], w[2], w[3]

    @cuda.jit(device=True)
    def ldg_nc_v2_u32(arr, idx):
        w = _sim_bytes16(arr, idx, 8).view(np.uint32)
        return w[0], w[1]

    @cuda.jit(device=True)
    def mma_s8_16832(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lane, d = _warp_collective((int(a0), int(a1), int(a2), int(a3), int(b0), int(b1)), _mma_from_fragments)
        g, t = lane >> 2, lane & 3
        return (np.int32(_wrap_s32(d[g, 2 * t] + c0)), np.int32(_wrap_s32(d[g, 2 * t + 1] + c1)),
                np.int32(_wrap_s32(d[g + 8, 2 * t] + c2)), np.int32(_wrap_s32(d[g + 8, 2 * t + 1] + c3)))

    @cuda.jit(device=True)
    def cp_async_16(smem, sidx, gmem, gidx):
        _sim_bytes16(smem, sidx)[:] = _sim_bytes16(gmem, gidx)

    @cuda.jit(device=True)
    def cp_async_commit():
        pass

    @cuda.jit(device=True)
    def cp_async_wait_all():
        pass

    cp_async_wait_1 = cp_async_wait_all

    @cuda.jit(device=True)
    def ldmatrix_x4(smem, idx):
        lane, regs = _warp_collective(_sim_bytes16(smem, idx).view(np.uint32).copy(), _ldmatrix_plain)
        return regs[lane, 0], regs[lane, 1], regs[lane, 2], regs[lane, 3]

    @cuda.jit(device=True)
    def ldmatrix_x4_trans(smem, idx):
        lane, regs = _warp_collective(_sim_bytes16(smem, idx).view(np.uint32).copy(), _ldmatrix_trans)
        return regs[lane, 0], regs[lane, 1], regs[lane, 2], regs[lane, 3]

    @cuda.jit(device=True)
    def i32_as_f32(i):
        return np.array([i], np.int64).astype(np.int32).view(np.float32)[0]

    @cuda.jit(device=True)
    def ex2_approx(x):
        y = np.float32(np.exp2(np.float32(x)))
        return np.float32(0.0) if abs(y) < np.float32(2.0 ** -126) else y      # ftz (NaN stays NaN)

    @cuda.jit(device=True)
    def shfl_xor_i32(v, lane_mask):
        lane, vals = _warp_collective(int(v), list)
        return np.int32(vals[lane ^ lane_mask])

    @cuda.jit(device=True)
    def shfl_xor_f32(v, lane_mask):
        lane, vals = _warp_collective(float(v), list)
        return np.float32(vals[lane ^ lane_mask])

    @cuda.jit(device=True)
    def shfl_xor_f64(v, lane_mask):
        lane, vals = _warp_collective(float(v), list)
        return np.float64(vals[lane ^ lane_mask])

    @cuda.jit(device=True)
    def shfl_idx_f32(v, src_lane):
        lane, vals = _warp_collective(float(v), list)
        return np.float32(vals[src_lane])

    @cuda.jit(device=True)
    def vote_any(pred):
        lane, vals = _warp_collective(bool(pred), list)
        return any(vals)

    @cuda.jit(device=True)
    def syncwarp():
        _warp_collective(0, len)

    @cuda.jit(device=True)
    def griddep_nothing():              # the simulator has no programmatic launches
        pass

    return (dp4a, ldg_nc_v4_u32, ldg_nc_v2_u32, mma_s8_16832, cp_async_16, cp_async_commit, cp_async_wait_all,
            cp_async_wait_1, ldmatrix_x4, ldmatrix_x4_trans, i32_as_f32, shfl_xor_i32, shfl_xor_f32, shfl_xor_f64,
            shfl_idx_f32, syncwarp, griddep_nothing, griddep_nothing, cp_async_wait_all, vote_any, ex2_approx)


def install_simulator_patches():
    """What the kernels need from the simulator beyond its stock behaviour (each patch says why)."""
    from numba.cuda.simulator import kernel
    kernel.BlockManager.run = _block_manager_run
    _accept_shared_alignment()


def _accept_shared_alignment():
    """Let kernels write ``cuda.shared.array(..., alignment=16)`` (needed by cp.async) under the simulator.

    The simulator raises on any ``alignment=``; its numpy-backed arrays need none. Its static shared
    arrays are identified by the calling source line, so the replacement repeats that lookup itself
    (``_allocations`` keyed by file and line of the kernel's call) rather than delegating through an
    extra frame, which would make every allocation alias one array. The lookup is one atomic setdefault, so
    every thread of the block gets the same array.
    """
    from numba.cuda.simulator import kernelapi
    original = kernelapi.FakeCUDAShared.array
    if getattr(original, "_ninfer_accepts_alignment", False):
        return

    def array(self, shape, dtype, alignment=None):
        if shape == 0:                               # dynamic shared memory is not keyed by line
            return original(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        # setdefault, not get-then-set: the block's threads run this concurrently, and a thread switched out
        # between the two would keep an array of its own (the stock simulator's race; seen as a rare
        # failure of a kernel with three static tables, 2026-12-04)
        return self._allocations.setdefault(caller, np.empty(shape, dtype))
    array._ninfer_accepts_alignment = True
    kernelapi.FakeCUDAShared.array = array


_POLL_S = 1e-4   # between the manager's polls (0 and 1e-3 measured within 15 % of it on the GDN kernels)


def _block_manager_run(self, grid_point, *args):
    """The simulator's BlockManager.run without its busy loop: one thread per CUDA thread of the block; the
    manager releases them from syncthreads() once every live one waits there, and re-raises a thread's
    exception after unblocking the others. The stock loop polls the threads without pause and so holds
    the interpreter lock the simulated threads need for most of each switch interval; sleeping between
    polls made the simulator suite 5-10 times faster (test_act_f16.py 243 -> 22 s, test_sample_kernel.py
    126 -> 21 s, a GDN prefill at T 1 105 -> 24 s on a 2-core machine)."""
    from numba.cuda.simulator.kernel import BlockThread
    threads = [BlockThread(lambda: self._f(*args), self, grid_point, point, self._debug)
               for point in np.ndindex(*self._block_dim)]

    def raise_first_error():
        """A thread's error, after releasing the others from syncthreads() with their abort flag set."""
        failed = next((t for t in threads if t.exception), None)
        if failed is not None:
            for t in threads:
                t.abort, t.syncthreads_blocked = True, False
                t.syncthreads_event.set()
            raise failed.exception[0].with_traceback(failed.exception[1])

    for t in threads:
        t.start()
    live = threads
    while live:
        time.sleep(_POLL_S)
        raise_first_error()
        live = [t for t in live if t.is_alive()]
        if live and all(t.syncthreads_blocked for t in live):
            for t in live:
                t.syncthreads_blocked = False
                t.syncthreads_event.set()
    raise_first_error()                       # one raised by the last thread to finish
