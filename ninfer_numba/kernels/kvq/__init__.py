"""KV cache in 3 and 4 bits: randomized Hadamard rotation and Lloyd-Max codes (the specification, ``ref``).

Nothing is imported here, so ``from ninfer_numba.kernels.kvq import ref`` stays free of numba.
"""
