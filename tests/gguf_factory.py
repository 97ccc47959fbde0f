"""Test-only qwen35 GGUF writer with every knob: shapes, tensor types, tied/untied, deliberate defects.

Independent of ninfer_numba.synth: float weights are drawn here and stored through the ``gguf`` package's
own quantizer, so the loader and the reference model are checked against files we did not write ourselves.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class TinySpec:
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 48
    n_rot: int = 16
    sections: tuple = (3, 3, 2, 0)
    n_ff: int = 96
    ssm_groups: int = 2
    ssm_heads: int = 4
    ssm_state: int = 24
    conv_kernel: int = 4
    n_vocab: int = 320
    tied: bool = False
    eps: float = 1e-6
    rope_base: float = 1e6

    def with_(self, **kw) -> "TinySpec":
        return replace(self, **kw)


def tensors_for(s: TinySpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Float32 weights in NumPy order, scaled like a trained model's (unit-ish activations)."""
    d, e, conv = s.head_dim, s.n_embd, 2 * s.ssm_groups * s.ssm_state + s.ssm_heads * s.ssm_state
    inner = s.ssm_heads * s.ssm_state

    def mat(n, k, gain=1.0):
        return (rng.standard_normal((n, k)) * gain / np.sqrt(k)).astype(np.float32)

    def norm(n):
        return rng.uniform(0.8, 1.2, n).astype(np.float32)

    t = {"token_embd.weight": mat(s.n_vocab, e, 3.0), "output_norm.weight": norm(e)}
    if not s.tied:
        t["output.weight"] = mat(s.n_vocab, e, 3.0)
    for i in range(s.n_layer):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = norm(e)
        t[b + "post_attention_norm.weight"] = norm(e)
        t[b + "ffn_gate.weight"] = mat(s.n_ff, e)
        t[b + "ffn_up.weight"] = mat(s.n_ff, e)
        t[b + "ffn_down.weight"] = mat(e, s.n_ff, 0.5)
        if (i + 1) % 4 == 0:
            t[b + "attn_q.weight"] = mat(2 * d * s.n_head, e)
            t[b + "attn_k.weight"] = mat(d * s.n_head_kv, e)
            t[b + "attn_v.weight"] = mat(d * s.n_head_kv, e)
            t[b + "attn_output.weight"] = mat(e, d * s.n_head, 0.5)
            t[b + "attn_q_norm.weight"] = norm(d)
            t[b + "attn_k_norm.weight"] = norm(d)
        else:
            t[b + "attn_qkv.weight"] = mat(conv, e)
            t[b + "attn_gate.weight"] = mat(inner, e)
            t[b + "ssm_conv1d.weight"] = (rng.standard_normal((conv, s.conv_kernel)) * 0.5).astype(np.float32)
            t[b + "ssm_dt.bias"] = rng.uniform(-3, -1, s.ssm_heads).astype(np.float32)
            t[b + "ssm_a"] = (-rng.uniform(0.5, 8, s.ssm_heads)).astype(np.float32)
            t[b + "ssm_beta.weight"] = mat(s.ssm_heads, e)
            t[b + "ssm_alpha.weight"] = mat(s.ssm_heads, e)
            t[b + "ssm_norm.weight"] = norm(s.ssm_state)
            t[b + "ssm_out.weight"] = mat(e, inner, 0.5)
    return t


def is_matrix(name: str, arr: np.ndarray) -> bool:
    return arr.ndim == 2 and "ssm_conv1d" not in name


def write_gguf(path, s: TinySpec, tensors: dict[str, np.ndarray], *, matrix_type=QT.F32,
               arch: str = "qwen35", skip_keys: tuple = (), vocab_tokens: list[str] | None = None,
               alignment: int | None = None, extra_kv=None) -> str:
    """Write ``tensors`` with every matrix stored as ``matrix_type`` (others F32); ``alignment`` writes an
    explicit general.alignment; ``extra_kv(writer)`` adds keys after the standard ones."""
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    keys = {
        "context_length": lambda: w.add_context_length(4096),
        "embedding_length": lambda: w.add_embedding_length(s.n_embd),
        "block_count": lambda: w.add_block_count(s.n_layer),
        "feed_forward_length": lambda: w.add_feed_forward_length(s.n_ff),
        "head_count": lambda: w.add_head_count(s.n_head),
        "head_count_kv": lambda: w.add_head_count_kv(s.n_head_kv),
        "key_length": lambda: (w.add_key_length(s.head_dim), w.add_value_length(s.head_dim)),
        "eps": lambda: w.add_layer_norm_rms_eps(s.eps),
        "rope": lambda: (w.add_rope_dimension_count(s.n_rot), w.add_rope_freq_base(s.rope_base),
                         w.add_rope_dimension_sections(list(s.sections))),
        "ssm": lambda: (w.add_ssm_conv_kernel(s.conv_kernel), w.add_ssm_inner_size(s.ssm_heads * s.ssm_state),
                        w.add_ssm_state_size(s.ssm_state), w.add_ssm_group_count(s.ssm_groups),
                        w.add_ssm_time_step_rank(s.ssm_heads)),
        "interval": lambda: w.add_full_attention_interval(4),
    }
    for k, fn in keys.items():
        if k not in skip_keys:
            fn()
    if extra_kv is not None:
        extra_kv(w)
    if vocab_tokens is None:
        w.add_tokenizer_model("none")
        w.add_vocab_size(s.n_vocab)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(vocab_tokens)
    for name, arr in tensors.items():
        if is_matrix(name, arr) and matrix_type != QT.F32:
            if matrix_type == QT.F16:
                w.add_tensor(name, arr.astype(np.float16))
            elif matrix_type == QT.BF16:
                w.add_tensor(name, gguf.quants.quantize(arr, QT.BF16), raw_dtype=QT.BF16)
            else:
                q = gguf.quants.quantize(arr, matrix_type)
                w.add_tensor(name, q, raw_dtype=matrix_type)
        else:
            w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
