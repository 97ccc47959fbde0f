"""Gated attention (QK-norm, partial NEOX RoPE, f16 KV cache, causal GQA softmax, sigmoid output gate).

``ref`` is pure NumPy and importing this package imports nothing else; the kernels live in ``rope``
(QK-norm + RoPE + cache store), ``decode`` (split-K over the cache) and ``prefill`` (tiled online softmax),
which import numba. See README.md for layouts and the math.
"""
from ninfer_numba.kernels.flash_attn.ref import (  # noqa: F401
    attention_ref, attn_mixer_ref, gate_ref, qk_norm_rope_ref, rmsnorm_ref, rope_neox_ref,
    split_proj_ref, split_q_gate_ref,
)
