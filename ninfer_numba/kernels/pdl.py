"""Programmatic dependent launch (Hopper): a kernel of the decode step may be scheduled while the kernel
before it in the stream is still running, and waits for it on the device instead of in the launcher.

A decode step is ~300 small dependent kernels; each one's launch and block scheduling otherwise starts
only when the one before it has drained (1.2 µs for the smallest in benchmarks/e2e/decode_profile.py).

Contract. A kernel compiled with ``cached_jit(pdl=True)`` calls ``griddep_wait()`` (kernels/ptx.py, as every
inline PTX) before it touches any global memory (it returns once every grid this one depends on has
completed and its writes are visible), then ``griddep_launch_dependents()`` (the next kernel may now be scheduled; its own wait still holds it
until this grid completes). Both are no-ops when the launch was not programmatic, on GPUs before sm_90 and
in the simulator. Only launches of such kernels made inside ``programmatic_launches()`` get the launch
attribute (``programmatic_stream_serialization``, which stream capture turns into programmatic graph
edges); every other launch keeps full stream order, and a kernel that follows an unmarked one starts only
when that one completes (an unmarked kernel never triggers early). So a kernel without the two calls is
never overlapped, whatever runs around it.
"""
from __future__ import annotations

import contextlib
import threading

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.ptx import griddep_launch_dependents, griddep_wait  # noqa: F401 (the contract's calls)

_state = threading.local()          # .enabled: inside programmatic_launches(); .this_launch: for the next launch
_installed = False


def _target_cc() -> tuple[int, int]:
    """The compute capability kernels are compiled for (the current device's)."""
    return tuple(cuda.get_current_device().compute_capability)


def mark(func) -> None:
    """Record that the Python kernel ``func`` keeps the contract above (cached_jit(pdl=True) calls this)."""
    func._ninfer_pdl = True


def _install() -> None:
    """Wrap numba's kernel launch: a marked kernel launched inside programmatic_launches() gets the
    programmatic-serialization attribute. numba's dispatcher builds a cuda.core LaunchConfig and calls
    cuda.core's launch; the wrapper of the dispatcher's call flags the launch, the wrapper of launch
    rebuilds that config with the attribute set."""
    global _installed
    if _installed or SIMULATOR:
        return
    from ninfer_numba.kernels.fast_launch import install
    install()                   # under this wrapper: its call sets the flag the fast path's launch reads
    import numba.cuda.dispatcher as nd
    from cuda.core import LaunchConfig

    dispatcher_call, core_launch = nd.CUDADispatcher.call, nd.launch

    def call(self, args, launch_config):
        # the dispatcher, not the compiled _Kernel: a kernel loaded from numba's disk cache has no py_func
        _state.this_launch = getattr(_state, "enabled", False) and getattr(self.py_func, "_ninfer_pdl", False)
        try:
            return dispatcher_call(self, args, launch_config)
        finally:
            _state.this_launch = False

    def launch(stream, config, kernel, *kernel_args):
        if getattr(_state, "this_launch", False) and not config.is_cooperative:
            config = LaunchConfig(grid=config.grid, block=config.block, shmem_size=config.shmem_size,
                                  programmatic_stream_serialization=True)
        return core_launch(stream, config, kernel, *kernel_args)

    nd.CUDADispatcher.call, nd.launch = call, launch
    _installed = True


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True):
    """Launches of marked kernels inside this block are programmatic (on sm_90 and later)."""
    enabled = enabled and not SIMULATOR and _target_cc() >= (9, 0)
    if enabled:
        _install()
    previous = getattr(_state, "enabled", False)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous
