"""Eager kernel launches with less host work per launch: numba's overload chosen once per argument key, and
each device array's kernel parameters flattened once per array object.

Where a forward runs eagerly (a packed prefill of several prompts, whose mixers launch per prompt; a prefill
chunk seen for the first time) the host's launching is the forward's cost: a packed forward of 15 prompts
(9B, H200) enqueued its ~2,340 launches in 327 ms and then waited 4 ms for the GPU. Under cProfile, numba's
per-launch path spent most of that in ``_Kernel._prepare_args``: for every device-array argument, a strided
memory view made anew, a context lookup, then the array's size, item size, pointer, shape and strides
appended (benchmarks/NOTES.md, session 25). A device array's parameters never change (its shape and memory
are fixed when it is made; the forward reuses its views: model/buffers), so they are kept on the array the
first time and appended from there; the overload comes from a dictionary keyed by what decides numba's
typing (arg_key) instead of numba's typing of every argument. Everything else is numba's own
launch: the same LaunchConfig fields, cuda.core's ``launch`` (which kernels/pdl.py may wrap), the same
per-device function.

A launch takes numba's own path when anything here does not apply: the simulator, a dispatcher specialised
or sensitive to its launch configuration, pre-launch callbacks, a debug kernel, argument extensions, and
the first launch of each argument key. ``NINFER_FAST_LAUNCH=0`` keeps numba's path for every launch.
"""
from __future__ import annotations

import os

import numpy as np

_KARGS = "_ninfer_kernel_params"       # attribute holding a device array's flattened kernel parameters
_installed = False


def arg_key(a):
    """What decides numba's typing of a launch argument: an array's class, dtype, rank and layout inputs
    (contiguity, broadcast strides); a scalar's class; a tuple's items'."""
    if isinstance(a, tuple):
        return tuple(arg_key(x) for x in a)
    strides = getattr(a, "strides", None)
    if strides is None:
        return type(a)
    flags = a.flags
    return type(a), a.dtype, a.ndim, flags["C_CONTIGUOUS"], flags["F_CONTIGUOUS"], 0 in strides


def _plannable(a, device_array: type) -> bool:
    """Arguments whose arg_key decides their numba type: device arrays, Python and NumPy scalars, tuples of
    them (a host array's type also carries its read-only and alignment flags)."""
    if isinstance(a, tuple):
        return all(_plannable(x, device_array) for x in a)
    return type(a) is device_array or isinstance(a, (bool, int, float, np.bool_, np.integer, np.floating))


def install() -> bool:
    """Route numba's kernel launches through the fast path (once; not under the simulator or with
    NINFER_FAST_LAUNCH=0). Returns whether it is installed."""
    global _installed
    from ninfer_numba.kernels import pdl
    from ninfer_numba.kernels.numba_env import SIMULATOR
    # never over pdl.py's wrapper of the dispatcher's call: this call would bypass it (pdl installs this first)
    if _installed or pdl._installed or SIMULATOR or os.environ.get("NINFER_FAST_LAUNCH", "1") == "0":
        return _installed
    import numba.cuda.dispatcher as nd
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    numba_call = nd.CUDADispatcher.call
    configs: dict = {}                     # (grid, block, shared bytes, cooperative) -> LaunchConfig

    def config_for(grid, block, shmem: int, cooperative: bool):
        key = (grid, block, shmem, cooperative)
        cfg = configs.get(key)
        if cfg is None:
            coop = {"is_cooperative" if nd.CUDA_CORE_GE_1_0 else "cooperative_launch": cooperative}
            cfg = configs[key] = nd.LaunchConfig(grid=grid, block=block, shmem_size=shmem, **coop)
        return cfg

    def call(self, args, launch_config):
        if (launch_config.pre_launch_callbacks or self.specialized
                or getattr(self, "_launch_config_sensitive", False)):
            return numba_call(self, args, launch_config)
        plans = self.__dict__.setdefault("_ninfer_plans", {})
        key = tuple(map(arg_key, args))
        kernel = plans.get(key)
        if kernel is None:                  # numba's path once: it compiles if needed and types the arguments
            numba_call(self, args, launch_config)
            if key not in plans:
                found = self.overloads.get(tuple(self.typeof_pyval(a) for a in args))
                usable = (found is not None and not found.debug and not found.extensions
                          and not getattr(found, "launch_config_sensitive", False)
                          and all(_plannable(a, DeviceNDArray) for a in args))
                plans[key] = found if usable else False
            return None
        if kernel is False:
            return numba_call(self, args, launch_config)
        stream = launch_config.stream
        params: list = []
        for ty, value in zip(kernel.argument_types, args):
            if type(value) is DeviceNDArray:
                flat = value.__dict__.get(_KARGS)
                if flat is None:
                    flat = []
                    kernel._prepare_args(ty, value, stream, [], flat)    # a device array: nothing to write back
                    flat = value.__dict__[_KARGS] = tuple(flat)
                params.extend(flat)
            else:                                                        # a scalar (or a tuple of them)
                kernel._prepare_args(ty, value, stream, [], params)
        cfg = config_for(launch_config.griddim, launch_config.blockdim, launch_config.sharedmem, kernel.cooperative)
        nd.launch(stream, cfg, kernel._codelibrary.get_cufunc().kernel, *params)
        return None

    nd.CUDADispatcher.call = call
    _installed = True
    return True
