"""Weights on the GPU: Q8_0 repacked once into the kernels' layout, projections fused by rows.

Layout (kernels/q8/ref.py): a matrix of N output rows and K inputs is ``wq: int8 [N, K]`` plus
``ws: float16 [N, K/32]``, 34 bytes per 32 weights as in the file. Projections that read the same input
are stacked into one matrix so one GEMV streams them together:
  GDN input       attn_qkv | attn_gate | ssm_beta | ssm_alpha   -> [C + Hv·S + 2·Hv, E]
  attention input attn_q | attn_k | attn_v                      -> [2·d·H + 2·d·Hkv, E]
  FFN input       ffn_gate | ffn_up                             -> [2·F, E]
The row order is the column order the mixers' kernels read (kernels/gdn/ref.py, kernels/flash_attn/ref.py).
Float matrices (F32/F16/BF16 files) are quantized to Q8_0 here, with a notice, since every GEMM is int8.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as QT

from ninfer_numba.formats.quants import quantize_q8_0, split_q8_0
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.model.weights import ModelWeights, log_to_stderr


@dataclass
class Q8Matrix:
    wq: object        # device int8 [N, K]
    ws: object        # device float16 [N, K/32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.wq.shape)

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.ws.nbytes


@dataclass
class GpuLayer:
    index: int
    is_attention: bool
    attn_norm: object
    post_norm: object
    w_in: Q8Matrix              # fused input projection of the token mixer
    w_out: Q8Matrix             # ssm_out or attn_output
    w_gate_up: Q8Matrix
    w_down: Q8Matrix
    small: dict = field(default_factory=dict)   # conv_w, ssm_a, dt_bias, ssm_norm or q_norm, k_norm


class GpuWeights:
    """The model's weights on the current device, or one shard's part of them (engine/shard_plan.py): the
    layers in ``layers`` (default all), the token embedding if ``embedding``, the output norm and head if
    ``head``; a part without them holds None there."""

    def __init__(self, w: ModelWeights, *, layers: range | None = None, embedding: bool = True,
                 head: bool = True, log=None) -> None:
        self.config = c = w.config
        self._w = w
        self._log = log or log_to_stderr
        self._converted: list[str] = []
        t0 = time.perf_counter()
        tied = c.tied_embeddings
        embd = self._stack(["token_embd.weight"]) if embedding or (head and tied) else None
        self.token_embd = embd if embedding else None      # a tied head on its own shard keeps its own copy
        self.output = (embd if tied else self._stack(["output.weight"])) if head else None
        self.output_norm = self._vec("output_norm.weight") if head else None
        self.layers = [self._layer(i) for i in (range(c.n_layer) if layers is None else layers)]
        if self._converted:
            self._log(f"note: {len(self._converted)} float matrices quantized to Q8_0 at load "
                      f"(e.g. {self._converted[0]}); every GEMM in this engine is int8")
        self.upload_seconds = time.perf_counter() - t0

    @property
    def nbytes(self) -> int:
        mats = [m for m in (self.token_embd, self.output) if m is not None]
        mats = mats[:1] if len(mats) == 2 and mats[0] is mats[1] else mats
        for L in self.layers:
            mats += [L.w_in, L.w_out, L.w_gate_up, L.w_down]
        return sum(m.nbytes for m in mats)

    def _split(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        t = self._w.info(name)
        if t.ggml_type == QT.Q8_0:
            return split_q8_0(self._w.file.tensor_bytes(name), t.shape)
        self._converted.append(name)
        return quantize_q8_0(self._w.dense(name))

    def _stack(self, names: list[str]) -> Q8Matrix:
        """Upload and row-stack 2-D Q8_0 tensors into one device matrix, one tensor on the host at a time."""
        shapes = [self._w.info(n).shape for n in names]
        k = shapes[0][1]
        n_rows = sum(s[0] for s in shapes)
        wq = cuda.device_array((n_rows, k), dtype=np.int8)
        ws = cuda.device_array((n_rows, k // 32), dtype=np.float16)
        r = 0
        for name, (rows, _) in zip(names, shapes):
            q, d = self._split(name)
            wq[r:r + rows].copy_to_device(q)
            ws[r:r + rows].copy_to_device(d)
            r += rows
        return Q8Matrix(wq, ws)

    def _vec(self, name: str) -> object:
        return cuda.to_device(np.ascontiguousarray(self._w.dense(name), dtype=np.float32))

    def _layer(self, i: int) -> GpuLayer:
        c, b = self.config, f"blk.{i}."
        attn = c.is_attention_layer(i)
        if attn:
            w_in = self._stack([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"])
            w_out = self._stack([b + "attn_output.weight"])
            small = {"q_norm": self._vec(b + "attn_q_norm.weight"), "k_norm": self._vec(b + "attn_k_norm.weight")}
        else:
            w_in = self._stack([b + "attn_qkv.weight", b + "attn_gate.weight", b + "ssm_beta.weight",
                                b + "ssm_alpha.weight"])
            w_out = self._stack([b + "ssm_out.weight"])
            small = {"conv_w": self._vec(b + "ssm_conv1d.weight"), "ssm_a": self._vec(b + "ssm_a"),
                     "dt_bias": self._vec(b + "ssm_dt.bias"), "ssm_norm": self._vec(b + "ssm_norm.weight")}
        return GpuLayer(i, attn, self._vec(b + "attn_norm.weight"), self._vec(b + "post_attention_norm.weight"),
                        w_in, w_out, self._stack([b + "ffn_gate.weight", b + "ffn_up.weight"]),
                        self._stack([b + "ffn_down.weight"]), small)
