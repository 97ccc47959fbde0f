"""Synthetic random-weight Qwen3.5 GGUF files at the published shapes.

Every 2-D matmul weight is Q8_0 (token_embd and output included), norms, ssm_conv1d, ssm_a and
ssm_dt.bias are F32, as the converter and llama-quantize produce them (reference/qwen35-format.md §4),
so llama.cpp b8462 loads the same file we benchmark. Quants are drawn directly as int8 with one float16
scale per block: no float matrix ever exists, and the file is written tensor by tensor, so memory stays
at one tensor (≤ 1.1 GB for the 9B output matrix) whatever the model size.

Scaling: a projection reading an RMS-normalised input has weight std 1/√K, so its outputs are ~unit;
projections back into the residual stream are halved; the output matrix has std 3/√n_embd, so logits
have a standard deviation near 3 at every size (the final RMSNorm fixes the input scale).

Variants for the correctness checks: ``block_scales="one"`` gives every block of a matrix the same scale (as
a whole-tensor quantizer writes it), where the default draws each block's scale; ``matrix_type="f16"`` or
``"f32"`` stores the same matrices dequantized (q·d) as floats, the files llama.cpp's float paths read.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import gguf

from ninfer_numba.formats.quants import Q8_BLOCK, pack_q8_0

UNIFORM_INT8_STD = 127 / np.sqrt(3.0)   # std of integers uniform on [-127, 127]


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    ssm_groups: int
    ssm_heads: int
    ssm_state: int
    n_rot: int
    sections: tuple[int, int, int, int]
    tied: bool
    n_vocab: int = 248320


SHAPES: dict[str, Shape] = {
    # tiny: 4 layers (3 GDN + 1 attention), runs in milliseconds on the CPU reference; C = 128 conv channels
    # keeps llama.cpp's CUDA conv kernel happy (channels % 128 == 0).
    "tiny": Shape(64, 4, 2, 1, 32, 128, 2, 4, 16, 16, (3, 3, 2, 0), True),
    "0.8b": Shape(1024, 24, 8, 2, 256, 3584, 16, 16, 128, 64, (11, 11, 10, 0), True),
    "2b": Shape(2048, 24, 8, 2, 256, 6144, 16, 16, 128, 64, (11, 11, 10, 0), True),
    "4b": Shape(2560, 32, 16, 4, 256, 9216, 16, 32, 128, 64, (11, 11, 10, 0), True),
    "9b": Shape(4096, 32, 16, 4, 256, 12288, 16, 32, 128, 64, (11, 11, 10, 0), False),
    "27b": Shape(5120, 64, 24, 4, 256, 17408, 16, 48, 128, 64, (11, 11, 10, 0), False),
}
CONV_KERNEL = 4
FULL_ATTN_INTERVAL = 4


def tensor_plan(s: Shape, tied: bool) -> Iterator[tuple[str, tuple[int, ...], str, float]]:
    """(name, NumPy shape, kind, scale) for every tensor, in file order. kind: q8 | norm | f32."""
    d, e = s.head_dim, s.n_embd
    conv = 2 * s.ssm_groups * s.ssm_state + s.ssm_heads * s.ssm_state
    inner = s.ssm_heads * s.ssm_state
    yield "token_embd.weight", (s.n_vocab, e), "q8", 3.0 / np.sqrt(e)
    for i in range(s.n_layer):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (e,), "norm", 0.0
        if (i + 1) % FULL_ATTN_INTERVAL == 0:
            yield b + "attn_q.weight", (2 * d * s.n_head, e), "q8", 1 / np.sqrt(e)
            yield b + "attn_k.weight", (d * s.n_head_kv, e), "q8", 1 / np.sqrt(e)
            yield b + "attn_v.weight", (d * s.n_head_kv, e), "q8", 1 / np.sqrt(e)
            yield b + "attn_output.weight", (e, d * s.n_head), "q8", 0.5 / np.sqrt(d * s.n_head)
            yield b + "attn_q_norm.weight", (d,), "norm", 0.0
            yield b + "attn_k_norm.weight", (d,), "norm", 0.0
        else:
            yield b + "attn_qkv.weight", (conv, e), "q8", 1 / np.sqrt(e)
            yield b + "attn_gate.weight", (inner, e), "q8", 1 / np.sqrt(e)
            yield b + "ssm_conv1d.weight", (conv, CONV_KERNEL), "f32", 0.5
            yield b + "ssm_dt.bias", (s.ssm_heads,), "dt_bias", 0.0
            yield b + "ssm_a", (s.ssm_heads,), "ssm_a", 0.0
            yield b + "ssm_beta.weight", (s.ssm_heads, e), "q8", 1 / np.sqrt(e)
            yield b + "ssm_alpha.weight", (s.ssm_heads, e), "q8", 1 / np.sqrt(e)
            yield b + "ssm_norm.weight", (s.ssm_state,), "norm", 0.0
            yield b + "ssm_out.weight", (e, inner), "q8", 0.5 / np.sqrt(inner)
        yield b + "post_attention_norm.weight", (e,), "norm", 0.0
        yield b + "ffn_gate.weight", (s.n_ff, e), "q8", 1 / np.sqrt(e)
        yield b + "ffn_up.weight", (s.n_ff, e), "q8", 1 / np.sqrt(e)
        yield b + "ffn_down.weight", (e, s.n_ff), "q8", 0.5 / np.sqrt(s.n_ff)
    yield "output_norm.weight", (e,), "norm", 0.0
    if not tied:
        yield "output.weight", (s.n_vocab, e), "q8", 3.0 / np.sqrt(e)


BLOCK_SCALES = ("varied", "one")
# matrix type -> (GGML tensor type, file type, NumPy dtype of a float matrix; None: Q8_0 blocks)
MATRIX_TYPES = {"q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0, None),
                "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16, np.dtype(np.float16)),
                "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32, np.dtype(np.float32))}


def _make_tensor(rng: np.random.Generator, shape: tuple[int, ...], kind: str, scale: float,
                 block_scales: str = "varied", matrix_type: str = "q8_0") -> np.ndarray:
    if kind == "q8":
        rows, k = shape
        q = rng.integers(-127, 128, size=(rows, k), dtype=np.int8)
        # "varied": per-block scales vary by ±50% so that scale handling is exercised, mean std = `scale`;
        # "one": a single scale for the whole matrix
        spread = rng.uniform(0.5, 1.5, size=(rows, k // Q8_BLOCK)) if block_scales == "varied" else 1.0
        d = np.broadcast_to(scale / UNIFORM_INT8_STD * spread, (rows, k // Q8_BLOCK)).astype(np.float16)
        float_dtype = MATRIX_TYPES[matrix_type][2]
        if float_dtype is None:
            return pack_q8_0(q, d)
        w = q.reshape(rows, k // Q8_BLOCK, Q8_BLOCK) * d[..., None].astype(np.float32)
        return w.reshape(rows, k).astype(float_dtype)
    if kind == "norm":                   # stored with the converter's +1 already applied
        return rng.uniform(0.8, 1.2, size=shape).astype(np.float32)
    if kind == "ssm_a":                  # −exp(A_log) with A uniform on [1, 16], as HF initialises it
        return (-rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    if kind == "dt_bias":                # inverse softplus of dt uniform on [0.001, 0.1]
        dt = rng.uniform(1e-3, 0.1, size=shape)
        return np.log(np.expm1(dt)).astype(np.float32)
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _write_metadata(w: gguf.GGUFWriter, s: Shape, vocab: bool, name: str, file_type: int) -> None:
    w.add_name(name)
    w.add_context_length(262144)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(s.n_rot)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_sections(list(s.sections))
    w.add_ssm_conv_kernel(CONV_KERNEL)
    w.add_ssm_inner_size(s.ssm_heads * s.ssm_state)
    w.add_ssm_state_size(s.ssm_state)
    w.add_ssm_group_count(s.ssm_groups)
    w.add_ssm_time_step_rank(s.ssm_heads)
    w.add_full_attention_interval(FULL_ATTN_INTERVAL)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if vocab:
        from ninfer_numba.formats.qwen_vocab import add_tokenizer_kv, qwen35_vocab_metadata
        add_tokenizer_kv(w, qwen35_vocab_metadata(s.n_vocab))
    else:
        w.add_tokenizer_model("none")
        w.add_vocab_size(s.n_vocab)


def write_synthetic_gguf(path: str | Path, shape: str = "tiny", *, seed: int = 0, vocab: bool = True,
                         tied: bool | None = None, block_scales: str = "varied", matrix_type: str = "q8_0",
                         progress: Callable[[str], None] | None = None) -> Path:
    """Write a synthetic qwen35 GGUF; returns its path. ``tied`` defaults to the published model's choice;
    ``block_scales`` and ``matrix_type``: the variants of the module docstring."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if block_scales not in BLOCK_SCALES:
        raise ValueError(f"unknown block_scales {block_scales!r}; choose one of {', '.join(BLOCK_SCALES)}")
    if matrix_type not in MATRIX_TYPES:
        raise ValueError(f"unknown matrix_type {matrix_type!r}; choose one of {', '.join(MATRIX_TYPES)}")
    tensor_type, file_type, float_dtype = MATRIX_TYPES[matrix_type]
    s = SHAPES[shape]
    tied = s.tied if tied is None else tied
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = list(tensor_plan(s, tied))
    w = gguf.GGUFWriter(str(path), "qwen35")
    _write_metadata(w, s, vocab, f"synthetic-qwen35-{shape}", file_type)
    for name, shp, kind, _ in plan:
        if kind == "q8" and float_dtype is None:
            nbytes = shp[0] * (shp[1] // Q8_BLOCK) * 34
            w.add_tensor_info(name, (shp[0], nbytes // shp[0]), np.dtype(np.uint8), nbytes,
                              raw_dtype=tensor_type)
        elif kind == "q8":
            w.add_tensor_info(name, shp, float_dtype, int(np.prod(shp)) * float_dtype.itemsize,
                              raw_dtype=tensor_type)
        else:
            w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(w_.nbytes for w_ in w.tensors[0].values())
    done, t0, last = 0, time.perf_counter(), 0.0
    for idx, (name, shp, kind, scale) in enumerate(plan):
        # one generator per tensor, seeded by (seed, index): any tensor can be regenerated alone
        rng = np.random.default_rng([seed, idx])
        data = _make_tensor(rng, shp, kind, scale, block_scales, matrix_type)
        w.write_tensor_data(data)
        done += data.nbytes
        now = time.perf_counter()
        if progress and (now - last > 2.0 or idx == len(plan) - 1):
            last = now
            progress(f"make-model {shape}: {done / 1e9:.2f}/{total / 1e9:.2f} GB "
                     f"({idx + 1}/{len(plan)} tensors, {now - t0:.0f} s)")
    w.close()
    return path


def stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
