"""The NumPy reference forward pass of a qwen35 model: the executable specification.

Built from the per-family NumPy references (kernels/*/ref.py) and the math in reference/qwen35-format.md §5:
embeddings → per layer [RMSNorm → gated attention or Gated DeltaNet → residual → RMSNorm → SwiGLU FFN →
residual] → RMSNorm → logits. It also serves tiny models on machines without a GPU.

Weights stay quantized in the memory map; each layer dequantizes its matrices when it runs them, large
ones a window of rows at a time (``ModelWeights.matmul``), so peak memory is the file plus a few hundred MB.

``emulate_int8=True`` models the kernels' storage precision: every matmul input quantized per 32-block to
int8 exactly as the GPU kernels do (kernels/quant_ref.py), and the attention queries, keys and values rounded
to float16 as the f16 KV cache holds them; so GPU logits can be compared with this model tightly (see
model/act_follow.py). The float mode is the spec.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ninfer_numba.config import ModelConfig
from ninfer_numba.kernels.flash_attn.ref import attn_mixer_ref, rmsnorm_ref
from ninfer_numba.kernels.gdn.ref import gdn_mixer_ref
from ninfer_numba.model.weights import ModelWeights


@dataclass
class ReferenceState:
    """Per-sequence memory: position, attention KV caches, GDN conv and recurrent states (all float32)."""
    max_seq: int
    pos: int = 0
    k_cache: dict[int, np.ndarray] = field(default_factory=dict)    # layer -> [max_seq, Hkv, d]
    v_cache: dict[int, np.ndarray] = field(default_factory=dict)    # layer -> [max_seq, Hkv, d]
    conv: dict[int, np.ndarray] = field(default_factory=dict)       # layer -> [K-1, C]
    ssm: dict[int, np.ndarray] = field(default_factory=dict)        # layer -> [Hv, S, S] (key dim, value dim)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class ReferenceModel:
    def __init__(self, weights: ModelWeights, *, emulate_int8: bool = False, gdn_chunked: bool = True) -> None:
        self.w = weights
        self.config: ModelConfig = weights.config
        self.emulate_int8 = emulate_int8
        self.gdn_chunked = gdn_chunked
        self.act_hook = None   # (h, xq, xs) -> xq to use, with emulate_int8 (model/act_follow.py)

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
    def _act(self, h: np.ndarray) -> np.ndarray:
        """The activation a matmul consumes: as is, or through the kernels' int8 per-32-block quantization."""
        if not self.emulate_int8:
            return h
        from ninfer_numba.kernels.quant_ref import quantize_q8_blocks_ref
        xq, xs = quantize_q8_blocks_ref(h)
        if self.act_hook is not None:
            xq = self.act_hook(h, xq, xs)
        t, k = xq.shape
        return (xq.astype(np.float32).reshape(t, k // 32, 32) * xs[..., None]).reshape(t, k)

    def _linear(self, h: np.ndarray, *names: str) -> np.ndarray:
        """h [T, K] through the named matrices, outputs side by side [T, ΣN]: the row-fused projections of
        model/gpu_weights.py (one activation quantization serves them all)."""
        a = self._act(h)
        if len(names) == 1:          # no concatenation copy: the output matrix's logits can be large
            return self.w.matmul(names[0], a)
        return np.concatenate([self.w.matmul(n, a) for n in names], axis=1)

    def _norm(self, name: str, x: np.ndarray) -> np.ndarray:
        return rmsnorm_ref(x, self.w.dense(name), self.config.rms_eps)

    def _attention(self, i: int, h: np.ndarray, st: ReferenceState) -> np.ndarray:
        c, b = self.config, f"blk.{i}."
        proj = self._linear(h, b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight")
        o = attn_mixer_ref(proj, self.w.dense(b + "attn_q_norm.weight"), self.w.dense(b + "attn_k_norm.weight"),
                           st.k_cache[i], st.v_cache[i], st.pos, c.n_head, c.n_head_kv, c.head_dim, c.n_rot,
                           c.rope_base, c.rms_eps, store_dtype=np.float16 if self.emulate_int8 else np.float32)
        return self._linear(o.astype(np.float32), b + "attn_output.weight")

    def _gdn(self, i: int, h: np.ndarray, st: ReferenceState) -> np.ndarray:
        c, b = self.config, f"blk.{i}."
        proj = self._linear(h, b + "attn_qkv.weight", b + "attn_gate.weight", b + "ssm_beta.weight",
                            b + "ssm_alpha.weight")
        y, st.conv[i], st.ssm[i] = gdn_mixer_ref(
            proj, self.w.dense(b + "ssm_conv1d.weight"), st.conv[i], self.w.dense(b + "ssm_a"),
            self.w.dense(b + "ssm_dt.bias"), self.w.dense(b + "ssm_norm.weight"), st.ssm[i],
            c.ssm_groups, c.ssm_heads, c.ssm_state, c.rms_eps, chunked=self.gdn_chunked)
        return self._linear(y.astype(np.float32), b + "ssm_out.weight")

    def _ffn(self, i: int, h: np.ndarray) -> np.ndarray:
        b = f"blk.{i}."
        gate, up = np.split(self._linear(h, b + "ffn_gate.weight", b + "ffn_up.weight"), 2, axis=1)
        return self._linear((_silu(gate) * up).astype(np.float32), b + "ffn_down.weight")

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
        x = self.w.embed(tokens)                                         # [T, n_embd] residual stream
        for i in range(self.config.n_layer):
            x = self.layer(i, x, st)
        st.pos += t
        return self.head(x if all_logits else x[-1:])

    def layer(self, i: int, x: np.ndarray, st: ReferenceState) -> np.ndarray:
        """Residual stream [T, n_embd] into layer i -> out of it, for tokens at st.pos onwards (st.pos is
        advanced by the caller once all layers ran)."""
        h = self._norm(f"blk.{i}.attn_norm.weight", x)
        mix = self._attention if self.config.is_attention_layer(i) else self._gdn
        x = x + mix(i, h, st)
        h = self._norm(f"blk.{i}.post_attention_norm.weight", x)
        return x + self._ffn(i, h)

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final residual stream [T, n_embd] -> logits [T, V]."""
        return self._linear(self._norm("output_norm.weight", x), self.w.output_name)
