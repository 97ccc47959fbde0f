"""The one place that imports numba.cuda.

numba-cuda 0.30.4 calls ``np.row_stack``, which numpy 2.5 removed; every kernel compile fails with
AttributeError until the alias is restored, and it must be restored before ``numba.cuda`` is imported.
Kernel modules therefore do ``from ninfer_numba.kernels.numba_env import cuda`` and never import numba.cuda
themselves. ``SIMULATOR`` is true under NUMBA_ENABLE_CUDASIM=1, where inline PTX is unavailable and the
intrinsics in ptx.py switch to pure-Python fallbacks.

Module-level kernels are compiled once per machine, not once per process: they are declared with
``cache=KERNEL_CACHE`` and numba keeps the compiled code on disk. Kernels made by factory functions
(closures specialised per shape) are compiled in each process: numba keys their cache entries by the
pickled closure cells, which hold device functions here. numba invalidates a kernel's cache entry
only when the kernel's own source file changes, not when a device function or a constant it uses from
another module does, so the cache folder is named by a digest of every kernel source file (and the numba-cuda
version): any change under kernels/ starts a fresh folder. NINFER_KERNEL_CACHE=0 turns the cache off;
NUMBA_CACHE_DIR, when set, is used as it is.
"""
import hashlib
import os
from importlib import metadata
from pathlib import Path

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config  # noqa: E402

from ninfer_numba.config import BackendUnavailableError  # noqa: E402
from numba import cuda  # noqa: E402

SIMULATOR = bool(config.ENABLE_CUDASIM)
KERNEL_CACHE = not SIMULATOR and os.environ.get("NINFER_KERNEL_CACHE", "1") != "0"


def kernel_sources_digest() -> str:
    """sha256 prefix over every kernel source file (path and bytes) and the numba-cuda version."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    try:
        h.update(metadata.version("numba-cuda").encode())
    except metadata.PackageNotFoundError:
        h.update(b"numba-cuda ?")
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _set_cache_dir() -> None:
    if not KERNEL_CACHE or os.environ.get("NUMBA_CACHE_DIR"):
        return
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = str(base / "ninfer_numba" / f"kernels-{kernel_sources_digest()}")
    os.environ["NUMBA_CACHE_DIR"] = folder       # survives a numba config reload
    config.CACHE_DIR = folder


_set_cache_dir()


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
