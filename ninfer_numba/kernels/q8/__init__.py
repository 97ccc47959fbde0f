"""The Q8_0 family: activation quantizers and the matrix products on Q8_0 weights.

``ref`` is pure NumPy (the specification: block quantization, the products, their error bounds, the
fragment order of the W8A16 activations). Kernels: ``quant_act`` (int8 activations, fused with RMSNorm or
SiLU-gating), ``gemv`` (decode, dp4a), ``gemv_rows``
(batched decode: up to 16 activation rows per weight read, int8 tensor cores), ``gemm`` (prefill on int8 activations: dp4a tiles or ``gemm_mma``'s
int8 tensor cores), ``act_f16`` and ``gemm_w8a16`` (prefill on Hopper: float16 activations, wgmma).
Nothing is imported here, so ``from ninfer_numba.kernels.q8 import ref`` stays free of numba.
"""
