"""The one place that imports numba.cuda.

numba-cuda 0.30.4 calls ``np.row_stack``, which numpy 2.5 removed; every kernel compile fails with
AttributeError until the alias is restored, and it must be restored before ``numba.cuda`` is imported.
Kernel modules therefore do ``from ninfer_numba.kernels.numba_env import cuda`` and never import numba.cuda
themselves. ``SIMULATOR`` is true under NUMBA_ENABLE_CUDASIM=1, where inline PTX is unavailable and the
intrinsics in ptx.py switch to pure-Python fallbacks.

The on-disk kernel cache lives in kernel_cache.py.
"""
import functools

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config  # noqa: E402

from ninfer_numba.config import BackendUnavailableError  # noqa: E402
from numba import cuda  # noqa: E402

SIMULATOR = bool(config.ENABLE_CUDASIM)


def device_inline(fn):
    """A device function inlined by NVVM (LLVM's alwaysinline), not by numba's IR inliner (``inline=True``):
    the IR inliner deep-copies the callee's IR at every call site, which for the coded-cache partial's
    nested helpers (a few thousand call sites) took 168 s and 5 GB to compile where this takes 9 s, with
    the same PTX (local arrays still promoted to registers). The simulator's jit has no forceinline."""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """The current GPU's multiprocessors (132 on an H100/H200, which the simulator stands in for): what
    launch-shape choices divide their blocks by."""
    return 132 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


def gpu_available() -> bool:
    """True when a real CUDA device can run kernels (False under the simulator)."""
    if SIMULATOR:
        return False
    try:
        return cuda.is_available()
    except Exception:  # a broken driver install reports itself as "no GPU" here; cuda.detect() says more
        return False


def check_numba_cuda() -> None:
    """Fail with a clear message when the cuda backend cannot run: numba's old built-in CUDA target active
    instead of the numba-cuda package, or no usable GPU (the simulator counts as usable)."""
    impl = getattr(cuda, "implementation", "NVIDIA")
    if not SIMULATOR and impl != "NVIDIA":
        raise BackendUnavailableError(f"numba.cuda resolves to the {impl!r} target; install numba-cuda==0.30.4")
    if not SIMULATOR and not gpu_available():
        try:
            n = cuda.cudadrv.driver.driver.get_device_count()
            reason = "no CUDA device" if n == 0 else f"{n} device(s) present but not usable"
        except Exception as e:  # the driver's own words: library missing, init failure, ...
            reason = " ".join(str(e).split()).rstrip(" :")
        raise BackendUnavailableError(f"the cuda backend needs an NVIDIA GPU and driver ({reason}); "
                                      "use --backend cpu (backend='cpu') to run the NumPy reference")
    from ninfer_numba.kernels.fast_launch import install
    install()                   # eager launches with less host work (fast_launch.py); none in the simulator
