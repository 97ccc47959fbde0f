"""The NumPy reference forward pass of a qwen35 model: the executable specification.

Built from the per-family NumPy references (kernels/*/ref.py) and the math in reference/qwen35-format.md §5:
embeddings → per layer [RMSNorm → gated attention or Gated DeltaNet → residual → RMSNorm → SwiGLU FFN →
residual] → RMSNorm → logits. It also serves tiny models on machines without a GPU.

Weights stay quantized in the memory map; each layer dequantizes its matrices when it runs them, large
ones a window of rows at a time (``ModelWeights.matmul``), so peak memory is the file plus a few hundred MB.
``weight_cache_bytes`` > 0 keeps dequantized matrices across forward calls instead (``DequantCache``: up to
4 bytes a weight), for runs of many calls such as one-token decode steps: the same products, bit for bit.

``emulate_int8=True`` models the kernels' storage precision: every matmul input quantized per 32-block to
int8 exactly as the GPU kernels do (kernels/q8/ref.py), and the attention queries, keys and values rounded
to float16 as the f16 KV cache holds them, and the Gated DeltaNet state pass's operands rounded to float16
where the GPU's prefill kernel rounds them (calls of more than one token: one token is the decode step's
float32 kernel); so GPU logits can be compared with this model tightly when it runs the sequence in the
GPU's own pieces (see benchmarks/e2e/act_follow.py). Rows the GPU ran through the W8A16 prefill GEMM (``f16_layer_rows`` /
``f16_head_rows``, by position) instead take their activations rounded to float16 and the weights
dequantized to float16, as that kernel does. The float mode is the spec.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from ninfer_numba.config import ModelConfig
from ninfer_numba.kernels.flash_attn.ref import attn_mixer_ref, rmsnorm_ref
from ninfer_numba.kernels.gdn.ref import gdn_mixer_ref
from ninfer_numba.kernels.kvq.ref import KV_TYPES, kv_round_trip
from ninfer_numba.model.weights import DequantCache, ModelWeights


@dataclass
class ReferenceState:
    """Per-sequence memory: position, attention KV caches, GDN conv and recurrent states (all float32)."""
    max_seq: int
    pos: int = 0
    k_cache: dict[int, np.ndarray] = field(default_factory=dict)    # layer -> [max_seq, Hkv, d]
    v_cache: dict[int, np.ndarray] = field(default_factory=dict)    # layer -> [max_seq, Hkv, d]
    conv: dict[int, np.ndarray] = field(default_factory=dict)       # layer -> [K-1, C]
    ssm: dict[int, np.ndarray] = field(default_factory=dict)        # layer -> [Hv, S, S] (key dim, value dim)

    def fill_random(self, n: int, seed: int = 0) -> None:
        """A sequence at depth n without its prefill (engine/cache.py SequenceState.fill_random): rows < n of
        the KV caches random unit normals, the position n."""
        if not 0 <= n <= self.max_seq:
            raise ValueError(f"a depth of {n} in a state of {self.max_seq} rows")
        rng = np.random.default_rng(seed)
        for cache in (*self.k_cache.values(), *self.v_cache.values()):
            cache[:n] = rng.standard_normal(cache[:n].shape)
        self.pos = n


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _one_blas_thread():
    """The Gated DeltaNet reference's many small float64 products on one BLAS thread: with more, OpenBLAS's
    thread hand-offs made each take 250 ms where one thread takes 0.9 ms (2 threads, 0.8B head shapes; a
    512-token call 116 s against 25 s, the same values), while the large matmuls keep every thread.
    threadpoolctl where installed (the bench extra), else no limit."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


class ReferenceModel:
    def __init__(self, weights: ModelWeights, *, emulate_int8: bool = False, gdn_chunked: bool = True,
                 kv_type: str = "f16", weight_cache_bytes: int = 0) -> None:
        if kv_type != "f16" and kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be f16 or one of {', '.join(KV_TYPES)}, not {kv_type!r}")
        self.kv_type = kv_type         # f16: keys and values kept as computed; k3v3 ...: coded (kernels/kvq)
        self.w = weights
        self.config: ModelConfig = weights.config
        self.emulate_int8 = emulate_int8
        self.gdn_chunked = gdn_chunked
        self.act_hook = None   # (h, f16_rows) -> (activation, f16_rows), with emulate_int8
        #                        (benchmarks/e2e/act_follow.py)
        self.f16_layer_rows = None     # bool [positions]: the layers' matmuls of these rows are W8A16
        self.f16_head_rows = None      # bool [positions]: likewise for the output head
        self.cache = DequantCache(weight_cache_bytes) if weight_cache_bytes > 0 else None

    def new_state(self, max_seq: int) -> ReferenceState:
        c = self.config
        st = ReferenceState(max_seq=max_seq)
        for i in range(c.n_layer):
            if c.is_attention_layer(i):
                st.k_cache[i] = np.zeros((max_seq, c.n_head_kv, c.head_dim), np.float32)
                st.v_cache[i] = np.zeros((max_seq, c.n_head_kv, c.head_dim), np.float32)
            else:
                st.conv[i] = np.zeros((c.conv_kernel - 1, c.conv_dim), np.float32)
                st.ssm[i] = np.zeros((c.ssm_heads, c.ssm_state, c.ssm_state), np.float32)
        return st

    # -- building blocks -------------------------------------------------------------------------------
    def _act(self, h: np.ndarray, f16_rows):
        """The activation a matmul consumes and which of its rows are W8A16: as is (float mode); emulated,
        int8 per-32-block quantization, or float16 rounding for the rows in f16_rows."""
        if not self.emulate_int8:
            return h, None
        if self.act_hook is not None:
            return self.act_hook(h, f16_rows)
        return emulate_activation(h, f16_rows), f16_rows

    def _linear(self, h: np.ndarray, *names: str, f16_rows=None) -> np.ndarray:
        """h [T, K] through the named matrices, outputs side by side [T, ΣN]: the row-fused projections of
        model/gpu_weights.py (one activation quantization serves them all)."""
        a, f16 = self._act(h, f16_rows)

        def product(x, f16_weights=False):
            if len(names) == 1:      # no concatenation copy: the output matrix's logits can be large
                return self.w.matmul(names[0], x, f16_weights=f16_weights, cache=self.cache)
            return np.concatenate([self.w.matmul(n, x, f16_weights=f16_weights, cache=self.cache) for n in names],
                                  axis=1)
        if f16 is None or not f16.any():
            return product(a)
        if f16.all():
            return product(a, True)
        out = np.empty((len(a), sum(self.w.info(n).shape[0] for n in names)), np.float32)
        out[f16], out[~f16] = product(a[f16], True), product(a[~f16])
        return out

    def _rows(self, mask, pos0: int, t: int):
        """The slice [pos0, pos0 + t) of a per-position mask (None: no W8A16 rows)."""
        return None if mask is None else np.asarray(mask[pos0:pos0 + t], bool)

    def _norm(self, name: str, x: np.ndarray) -> np.ndarray:
        return rmsnorm_ref(x, self.w.dense(name), self.config.rms_eps)

    def _attention(self, i: int, h: np.ndarray, st: ReferenceState, f16) -> np.ndarray:
        c, b = self.config, f"blk.{i}."
        proj = self._linear(h, b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight", f16_rows=f16)
        o = attn_mixer_ref(proj, self.w.dense(b + "attn_q_norm.weight"), self.w.dense(b + "attn_k_norm.weight"),
                           st.k_cache[i], st.v_cache[i], st.pos, c.n_head, c.n_head_kv, c.head_dim, c.n_rot,
                           c.rope_base, c.rms_eps, store_dtype=np.float16 if self.emulate_int8 else np.float32,
                           store=kv_round_trip(self.kv_type, i) if self.kv_type in KV_TYPES else None)
        return self._linear(o.astype(np.float32), b + "attn_output.weight", f16_rows=f16)

    def _gdn(self, i: int, h: np.ndarray, st: ReferenceState, f16) -> np.ndarray:
        c, b = self.config, f"blk.{i}."
        proj = self._linear(h, b + "attn_qkv.weight", b + "attn_gate.weight", b + "ssm_beta.weight",
                            b + "ssm_alpha.weight", f16_rows=f16)
        with _one_blas_thread():
            y, st.conv[i], st.ssm[i] = gdn_mixer_ref(
                proj, self.w.dense(b + "ssm_conv1d.weight"), st.conv[i], self.w.dense(b + "ssm_a"),
                self.w.dense(b + "ssm_dt.bias"), self.w.dense(b + "ssm_norm.weight"), st.ssm[i],
                c.ssm_groups, c.ssm_heads, c.ssm_state, c.rms_eps, chunked=self.gdn_chunked,
                f16_operands=self.emulate_int8 and self.gdn_chunked and len(h) > 1)
        return self._linear(y.astype(np.float32), b + "ssm_out.weight", f16_rows=f16)

    def _ffn(self, i: int, h: np.ndarray, f16) -> np.ndarray:
        b = f"blk.{i}."
        gate, up = np.split(self._linear(h, b + "ffn_gate.weight", b + "ffn_up.weight", f16_rows=f16), 2, axis=1)
        return self._linear((_silu(gate) * up).astype(np.float32), b + "ffn_down.weight", f16_rows=f16)

    # -- forward -----------------------------------------------------------------------------------------
    def forward(self, tokens, st: ReferenceState, *, all_logits: bool = True) -> np.ndarray:
        """Run ``tokens`` from ``st.pos`` on; returns logits [T, V] (or [1, V] for the last position)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        t = len(tokens)
        if t == 0:
            raise ValueError("forward needs at least one token")
        if st.pos + t > st.max_seq:
            raise ValueError(f"context overflow: {st.pos} + {t} tokens > max_seq {st.max_seq}")
        if tokens.min() < 0 or tokens.max() >= self.config.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.config.n_vocab})")
        if self.cache is not None:
            self.cache.new_pass()
        x = self.w.embed(tokens)                                         # [T, n_embd] residual stream
        for i in range(self.config.n_layer):
            x = self.layer(i, x, st)
        st.pos += t
        return self.head(x, st.pos - t) if all_logits else self.head(x[-1:], st.pos - 1)

    def layer(self, i: int, x: np.ndarray, st: ReferenceState) -> np.ndarray:
        """Residual stream [T, n_embd] into layer i -> out of it, for tokens at st.pos onwards (st.pos is
        advanced by the caller once all layers ran)."""
        f16 = self._rows(self.f16_layer_rows, st.pos, len(x))
        h = self._norm(f"blk.{i}.attn_norm.weight", x)
        mix = self._attention if self.config.is_attention_layer(i) else self._gdn
        x = x + mix(i, h, st, f16)
        h = self._norm(f"blk.{i}.post_attention_norm.weight", x)
        return x + self._ffn(i, h, f16)

    def head(self, x: np.ndarray, pos0: int = 0) -> np.ndarray:
        """Final residual stream [T, n_embd] of positions pos0.. -> logits [T, V]."""
        return self._linear(self._norm("output_norm.weight", x), self.w.output_name,
                            f16_rows=self._rows(self.f16_head_rows, pos0, len(x)))


def dequantize_activation(xq: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """int8 activations [T, K] with their block scales [T, K/32] back to float32, as the matmul sees them."""
    t, k = xq.shape
    return (xq.astype(np.float32).reshape(t, k // 32, 32) * xs[..., None]).reshape(t, k)


def emulate_activation(h: np.ndarray, f16_rows=None) -> np.ndarray:
    """h [T, K] float32 as the GPU kernels feed it to a matmul: per-32-block int8 quantization (dequantized
    back to float32), or float16 rounding for the rows in f16_rows (bool [T])."""
    from ninfer_numba.kernels.q8.ref import quantize_q8_blocks_ref
    int8_rows = slice(None) if f16_rows is None else ~np.asarray(f16_rows, bool)
    a = np.empty(h.shape, np.float32)
    a[int8_rows] = dequantize_activation(*quantize_q8_blocks_ref(h[int8_rows]))
    if f16_rows is not None:
        a[f16_rows] = h[f16_rows].astype(np.float16).astype(np.float32)
    return a
