"""Token selection: penalties, greedy, temperature / top-k / top-p / min-p sampling.

``ref`` is pure NumPy (the specification and the counter-based Philox draw the device shares); ``device``
runs it on the GPU (argmax, sampling, count updates) on top of ``radix_select`` (the histogram kernels
that find the truncation threshold without a sort). Nothing is imported here, so
``from ninfer_numba.kernels.sample import ref`` stays free of numba.
"""
