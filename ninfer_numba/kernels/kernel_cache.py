"""Compiled kernels kept on disk, so a process compiles only what no earlier process on this machine did.

Every kernel is declared with ``@cached_jit(...)`` (``cuda.jit`` plus the cache) instead of ``@cuda.jit``;
device functions keep ``@cuda.jit(device=True)``, since they are compiled into the kernels that call them.
numba-cuda stores each compiled specialization (PTX and cubin) in an index file per kernel, keyed by the
signature, the GPU, the kernel's bytecode and its closure cells.

Two things numba's own key gets wrong here, and what this module does about them:

- Kernels made by factory functions (closures specialised per shape) hold device functions in their cells.
  numba keys cells by their cloudpickle bytes, and pickling a device function pickles the inline-PTX
  intrinsics it calls, each of which carries a fresh uuid per process: the key never matches, every process
  recompiles and appends a new entry. ``_StableKeyCache`` describes cells instead: numbers as they are, a
  device function by its module, qualified name, bytecode and (recursively) its own cells.
- numba invalidates an entry only when the kernel's own source file changes, not when a device function or a
  constant from another module does. The cache folder is therefore named by a digest of every source file
  under kernels/ and the numba-cuda version: any change there starts a fresh folder.

NINFER_KERNEL_CACHE=0 turns the cache off; NUMBA_CACHE_DIR, when set, is used as it is. The CUDA simulator
never caches. ``cache_stats()`` counts specializations loaded from disk and compiled in this process.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import types
import weakref
from importlib import metadata
from pathlib import Path

import numpy as np
from numba import config

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda

ENABLED = not SIMULATOR and os.environ.get("NINFER_KERNEL_CACHE", "1") != "0"
_KERNELS_DIR = Path(__file__).resolve().parent
_kernels: weakref.WeakSet = weakref.WeakSet()   # every dispatcher made by cached_jit in this process


def sources_digest(root: Path = _KERNELS_DIR) -> str:
    """sha256 prefix over every .py file under root (relative path and bytes) and the numba-cuda version."""
    h = hashlib.sha256()
    try:
        h.update(metadata.version("numba-cuda").encode())
    except metadata.PackageNotFoundError:
        h.update(b"numba-cuda ?")
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> str | None:
    """The folder compiled kernels go to (None when the cache is off)."""
    if not ENABLED:
        return None
    return os.environ.get("NUMBA_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ninfer_numba"
        / f"kernels-{sources_digest()}")


def _point_numba_at_cache_dir() -> None:
    folder = cache_dir()
    if folder is not None and os.environ.get("NUMBA_CACHE_DIR") != folder:
        os.environ["NUMBA_CACHE_DIR"] = folder
        # numba re-reads its whole configuration from the environment at the next compile when the
        # environment changed since its last read, which would also undo settings made in code since;
        # reading it now makes that later check a no-op
        config.reload_config()


_point_numba_at_cache_dir()                          # before any kernel below is declared

_PLAIN = (int, float, bool, str, bytes, type(None), np.generic, np.dtype)


def describe(value, _seen=()):
    """A picklable description of one closure value, equal across processes when the value is.
    Raises TypeError for a value it cannot describe (the kernel is then not cached)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, tuple):
        return tuple(describe(v, _seen) for v in value)
    func = getattr(value, "py_func", None)            # a device function (a numba dispatcher)
    if isinstance(func, types.FunctionType):
        if id(func) in _seen:                         # recursion through a shared cell
            return ("device function", func.__module__, func.__qualname__)
        return ("device function", func.__module__, func.__qualname__, func.__code__.co_code,
                describe_cells(func, _seen + (id(func),)))
    name = getattr(value, "__qualname__", None) or getattr(value, "_name", None)
    module = getattr(value, "__module__", None)
    if isinstance(name, str) and module is not None:  # module-level functions, classes, PTX intrinsics
        return ("named", type(value).__name__, module, name)
    raise TypeError(f"cannot describe a {type(value).__name__} closure value for the kernel cache")


def describe_cells(func: types.FunctionType, _seen=()) -> tuple:
    return tuple(describe(c.cell_contents, _seen) for c in func.__closure__ or ())


def cells_digest(func: types.FunctionType) -> str:
    return hashlib.sha256(pickle.dumps(describe_cells(func), protocol=4)).hexdigest()


if ENABLED:
    from numba.cuda.dispatcher import CUDACache

    class _StableKeyCache(CUDACache):
        """CUDACache keyed by described cells instead of pickled ones (see the module docstring), and by the
        jit options (launch bounds), which numba leaves out of the key."""
        options = ""

        def _index_key(self, sig, codegen):
            func = self._py_func
            key = (sig, codegen.magic_tuple(), metadata.version("numba-cuda"), self.options,
                   (hashlib.sha256(func.__code__.co_code).hexdigest(), cells_digest(func)))
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key


def cached_jit(pdl: bool = False, **options):
    """``cuda.jit(**options)`` for a kernel, with its compiled specializations kept on disk. pdl: the kernel
    keeps kernels/pdl.py's contract (griddep_wait, then griddep_launch_dependents, before any global access),
    so its launches inside ``pdl.programmatic_launches()`` may overlap the kernel before them."""
    def wrap(func):
        if pdl:
            from ninfer_numba.kernels.pdl import mark
            mark(func)
        kernel = cuda.jit(**options)(func)
        if ENABLED:
            try:
                cells_digest(func)                    # a cell we cannot describe: compile every time
                kernel._cache = _StableKeyCache(kernel.py_func)
                kernel._cache.options = repr(sorted(options.items()))
            except (TypeError, RuntimeError):         # RuntimeError: numba found no writable cache folder
                pass
        if not SIMULATOR:
            _kernels.add(kernel)
        return kernel
    return wrap


def cache_stats() -> dict:
    """Kernel specializations this process loaded from the disk cache and compiled itself."""
    kernels = list(_kernels)
    return {"cache_dir": cache_dir(), "kernels": len(kernels),
            "cached": sum(isinstance(k._cache, CUDACache) for k in kernels) if ENABLED else 0,
            "loaded": sum(sum(k._cache_hits.values()) for k in kernels),
            "compiled": sum(sum(k._cache_misses.values()) for k in kernels)}
