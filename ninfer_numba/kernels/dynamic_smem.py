"""More than 48 KiB of dynamic shared memory for a numba kernel.

CUDA gives a kernel 48 KiB of dynamic shared memory unless its function attribute is raised first, and
numba-cuda has no automatic opt-in (reference/numba-cuda.md §7). ``allow_dynamic_smem`` compiles the
specialization the arguments select and raises its limit, once per kernel, argument types and device (again
when a launch asks for more).
"""
from __future__ import annotations

from ninfer_numba.kernels.fast_launch import arg_key
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

STATIC_SMEM_LIMIT = 48 * 1024           # bytes a launch may ask for without the attribute
_OPTED_IN: dict = {}                    # (kernel, argument key, device) -> the limit set, bytes


def allow_dynamic_smem(kernel, args, nbytes: int) -> None:
    """Raise ``kernel``'s dynamic shared-memory limit to ``nbytes`` for the specialization of ``args``; nothing
    to do at or under the default 48 KiB, or under the simulator."""
    if SIMULATOR or nbytes <= STATIC_SMEM_LIMIT:
        return
    # keyed by what decides numba's specialization (class, dtype, rank, layout of each argument), read from
    # attributes: numba's own typeof of every argument cost ~13 us each, 21 ms of a 9B prefill's 121 ms
    key = (kernel, tuple(arg_key(a) for a in args), cuda.get_current_device().id)
    if _OPTED_IN.get(key, 0) >= nbytes:
        return
    from numba.cuda.cudadrv.driver import binding, driver
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    cufunc = kernel.compile(argtypes).library.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    _OPTED_IN[key] = nbytes
