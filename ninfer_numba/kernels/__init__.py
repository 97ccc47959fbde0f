"""GPU kernels (numba-cuda) and their NumPy references.

Importing this package imports no numba: the *_ref modules are pure NumPy, so the CPU backend and the
tests that need only references stay light. Kernel modules import ``numba_env`` themselves.
"""
