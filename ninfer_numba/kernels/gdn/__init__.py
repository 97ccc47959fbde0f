"""Gated DeltaNet kernels: causal depthwise conv, recurrent step (decode), chunked form (prefill).

``ref`` is pure NumPy (the specification). The kernels: ``recurrent.gdn_decode_step`` (one token, one
fused kernel) and ``chunk.gdn_prefill`` (T tokens, chunk 64); README.md derives the chunked form.
Nothing is imported here, so ``from ninfer_numba.kernels.gdn import ref`` stays free of numba.
"""
