"""More than 48 KiB of dynamic shared memory for a numba kernel.

CUDA gives a kernel 48 KiB of dynamic shared memory unless its function attribute is raised first, and
numba-cuda has no automatic opt-in (reference/numba-cuda.md §7). ``allow_dynamic_smem`` compiles the
specialization the arguments select and raises its limit, once per kernel, argument types and device.
"""
from __future__ import annotations

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

STATIC_SMEM_LIMIT = 48 * 1024           # bytes a launch may ask for without the attribute
_OPTED_IN: set = set()


def allow_dynamic_smem(kernel, args, nbytes: int) -> None:
    """Raise ``kernel``'s dynamic shared-memory limit to ``nbytes`` for the specialization of ``args``; nothing
    to do at or under the default 48 KiB, or under the simulator."""
    if SIMULATOR or nbytes <= STATIC_SMEM_LIMIT:
        return
    from numba.cuda.cudadrv.driver import binding, driver
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    key = (kernel, argtypes, cuda.get_current_device().id)
    if key in _OPTED_IN:
        return
    cufunc = kernel.compile(argtypes).library.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    _OPTED_IN.add(key)
