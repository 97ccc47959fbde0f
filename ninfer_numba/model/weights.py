"""Model file → checked weights: the expected tensor table, validation, and host-side access.

``expected_tensors`` is the qwen35 tensor schema (reference/qwen35-format.md §3) in NumPy order. ``open_model``
checks every tensor's presence, shape and type, rejects extra tensors as llama.cpp does, and returns a
``ModelWeights`` whose tensors stay memory-mapped and quantized; ``dense`` dequantizes a tensor on use and
``matmul`` streams large matrices through a bounded row window so that peak memory stays near the file size.
A ``DequantCache`` passed to ``matmul`` keeps whole dequantized matrices for later calls, within a budget.
Tied embeddings (no ``output.weight``) are resolved here, once: ``output_name`` says which tensor to use.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ninfer_numba.config import ModelConfig, ModelFormatError
from ninfer_numba.formats.gguf_reader import GGUFFile, TensorInfo
from ninfer_numba.formats.quants import check_supported, dequantize, row_slice_bytes

MATMUL_WINDOW_ELEMENTS = 1 << 25   # 32M weights = 128 MB of float32 per dequantized window


def expected_tensors(c: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, NumPy shape, is_matrix) for every tensor a qwen35 file must hold."""
    d, e, inner = c.head_dim, c.n_embd, c.ssm_inner
    yield "token_embd.weight", (c.n_vocab, e), True
    yield "output_norm.weight", (e,), False
    if not c.tied_embeddings:
        yield "output.weight", (c.n_vocab, e), True
    for i in range(c.n_layer):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (e,), False
        yield b + "post_attention_norm.weight", (e,), False
        yield b + "ffn_gate.weight", (c.n_ff, e), True
        yield b + "ffn_up.weight", (c.n_ff, e), True
        yield b + "ffn_down.weight", (e, c.n_ff), True
        if c.is_attention_layer(i):
            yield b + "attn_q.weight", (2 * d * c.n_head, e), True
            yield b + "attn_k.weight", (d * c.n_head_kv, e), True
            yield b + "attn_v.weight", (d * c.n_head_kv, e), True
            yield b + "attn_output.weight", (e, d * c.n_head), True
            yield b + "attn_q_norm.weight", (d,), False
            yield b + "attn_k_norm.weight", (d,), False
        else:
            yield b + "attn_qkv.weight", (c.conv_dim, e), True
            yield b + "attn_gate.weight", (inner, e), True
            yield b + "ssm_conv1d.weight", (c.conv_dim, c.conv_kernel), False
            yield b + "ssm_dt.bias", (c.ssm_heads,), False
            yield b + "ssm_a", (c.ssm_heads,), False
            yield b + "ssm_beta.weight", (c.ssm_heads, e), True
            yield b + "ssm_alpha.weight", (c.ssm_heads, e), True
            yield b + "ssm_norm.weight", (c.ssm_state,), False
            yield b + "ssm_out.weight", (e, inner), True


@dataclass
class ModelWeights:
    file: GGUFFile
    config: ModelConfig

    @property
    def output_name(self) -> str:
        return "token_embd.weight" if self.config.tied_embeddings else "output.weight"

    def info(self, name: str) -> TensorInfo:
        return self.file.tensors[name]

    def dense(self, name: str) -> np.ndarray:
        """The whole tensor as float32 (for norms, small vectors and per-layer matrices)."""
        t = self.file.tensors[name]
        return dequantize(self.file.tensor_bytes(name), t.ggml_type, t.shape)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a 2-D tensor as float32."""
        t = self.file.tensors[name]
        raw = row_slice_bytes(self.file.tensor_bytes(name), t.ggml_type, t.shape[1], start, stop)
        return dequantize(raw, t.ggml_type, (stop - start, t.shape[1]))

    def matmul(self, name: str, x: np.ndarray, *, f16_weights: bool = False,
               cache: DequantCache | None = None) -> np.ndarray:
        """x [T, K] @ W[name].T -> [T, N] in float32, dequantizing W a window of rows at a time; with
        f16_weights each dequantized weight is first rounded to float16 (the W8A16 prefill GEMM's operand).
        With a cache holding (or taking) the whole matrix, the windows are row slices of it: the same values
        in the same layout, through the same products, so the result is the same bit for bit."""
        n, k = self.file.tensors[name].shape
        step = max(1, MATMUL_WINDOW_ELEMENTS // k)
        full = None if cache is None else cache.matrix(self, name, f16_weights)

        def window(s: int, e: int) -> np.ndarray:                         # W[s:e] as the product takes it
            if full is not None:
                return full[s:e]
            d = self.dense(name) if e - s == n else self.rows(name, s, e)
            return d.astype(np.float16).astype(np.float32) if f16_weights else d
        if step >= n:
            return x @ window(0, n).T
        out = np.empty((x.shape[0], n), dtype=np.float32)
        for s in range(0, n, step):
            e = min(n, s + step)
            out[:, s:e] = x @ window(s, e).T
        return out

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Embedding rows for token ids [T] -> [T, n_embd] float32 (only those rows are dequantized)."""
        return np.stack([self.rows("token_embd.weight", int(t), int(t) + 1)[0] for t in tokens]) \
            if len(tokens) else np.zeros((0, self.config.n_embd), np.float32)


class DequantCache:
    """Whole dequantized matrices kept across forward calls, within ``budget_bytes`` (float32: 4 bytes a
    weight). Entries are keyed by (name, f16_weights) and hold exactly the float32 values ``matmul`` would
    dequantize window by window (dequantization is elementwise, so a row slice of the whole equals the
    window), which is what keeps cached products bit-identical.

    Why a pass-aware policy, not plain LRU: a forward call sweeps the matrices in one fixed order, so when
    they do not all fit, plain LRU evicts each entry just before its next use and never hits. Here only
    stale entries, used in neither this pass nor the one before (``new_pass``: once per forward call), are
    evicted, least recently used first; when that frees too little the matrix is streamed uncached, and
    the entries that fit keep hitting. The other kind's entries (float16-rounded ones after prefill
    calls, when decode calls follow) go stale so and give way. A matrix is taken in only when it is asked
    for the second time: filling costs more than streaming (fresh pages, the whole-matrix temporaries), and a
    one-off use (a single prefill call's float16-rounded weights) would only pay that and crowd the budget.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self.entries: OrderedDict[tuple[str, bool], np.ndarray] = OrderedDict()   # least recent first
        self.last_pass: dict[tuple[str, bool], int] = {}
        self.pass_no = 0
        self.seen: set[tuple[str, bool]] = set()     # keys asked for once: the next ask fills the cache
        self.hits = self.misses = self.streamed = 0  # streamed: every ask answered None

    def new_pass(self) -> None:
        self.pass_no += 1

    def matrix(self, weights: ModelWeights, name: str, f16_weights: bool) -> np.ndarray | None:
        """The whole matrix [N, K] float32 as matmul uses it, or None (stream it) if it does not fit."""
        key = (name, f16_weights)
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            self.last_pass[key] = self.pass_no
            return self.entries[key]
        n, k = weights.info(name).shape
        size = 4 * n * k
        if key not in self.seen or not self._make_room(size):
            self.seen.add(key)
            self.streamed += 1
            return None
        self.misses += 1
        plain = self.entries.get((name, False))
        w = plain if plain is not None else weights.dense(name)         # the float16 copy derives from it
        if f16_weights:
            w = w.astype(np.float16).astype(np.float32)
        self.entries[key], self.last_pass[key] = w, self.pass_no
        self.used_bytes += size
        return w

    def _make_room(self, size: int) -> bool:
        if size > self.budget_bytes:
            return False
        stale = [key for key in self.entries if self.last_pass[key] < self.pass_no - 1]   # LRU order
        while self.used_bytes + size > self.budget_bytes and stale:
            key = stale.pop(0)
            self.used_bytes -= self.entries.pop(key).nbytes
            del self.last_pass[key]
        return self.used_bytes + size <= self.budget_bytes

    def summary(self) -> str:
        return (f"{len(self.entries)} matrices, {self.used_bytes / 2**30:.1f}/{self.budget_bytes / 2**30:.1f} GiB, "
                f"{self.hits} hits, {self.misses} misses, {self.streamed} streamed")


def log_to_stderr(message: str) -> None:
    """The default ``log`` of the loaders: one line to stderr, flushed."""
    print(message, file=sys.stderr, flush=True)


def open_model(path: str, log=log_to_stderr) -> ModelWeights:
    """Open and validate a qwen35 GGUF file. Raises ModelFormatError with a user-facing message. Tensors of
    multi-token-prediction blocks are left unread, with one line to ``log`` (default: stderr)."""
    f = GGUFFile(path)
    n_split = f.kv.get("split.count", 1)
    if n_split != 1:
        raise ModelFormatError(f"{path} is part {f.kv.get('split.no', 0)!r} of a GGUF split into {n_split!r} "
                               "files; join them first: llama-gguf-split --merge FIRST_PART OUT.gguf")
    config = ModelConfig.from_gguf(f.kv, set(f.tensors))
    expected = list(expected_tensors(config))
    names = {n for n, _, _ in expected}
    for name, shape, _ in expected:
        t = f.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{path}: required tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise ModelFormatError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} "
                                   "(NumPy order)")
        check_supported(name, t.ggml_type)
    mtp_prefixes = tuple(f"blk.{i}." for i in range(config.n_layer, config.n_layer + config.mtp_layers))
    unexpected = set(f.tensors) - names
    skipped = {n for n in unexpected if n.startswith(mtp_prefixes)}
    extra = sorted(unexpected - skipped)
    if config.mtp_layers:
        log(f"{path}: {len(skipped)} tensors of {config.mtp_layers} multi-token-prediction block(s) "
            f"(blk.{config.n_layer}.* onwards) left unread: this engine does not decode speculatively")
    if extra:
        more = f" (+{len(extra) - 5} more)" if len(extra) > 5 else ""
        raise ModelFormatError(f"{path}: unexpected tensors for a qwen35 model: {', '.join(extra[:5])}{more}")
    tok = f.tensors["token_embd.weight"]
    if tok.shape[0] != config.n_vocab:
        raise ModelFormatError(f"{path}: token_embd has {tok.shape[0]} rows but the vocabulary has "
                               f"{config.n_vocab} tokens")
    return ModelWeights(f, config)
