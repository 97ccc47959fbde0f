"""A sequence's device state, owned by the engine: KV caches (float16 or coded), GDN conv and recurrent states,
position counters. The GPU model's forward reads and writes it (model/qwen35.py ``forward(t, state)``); the
runners allocate one per sequence (``Qwen35Gpu.new_state``), snapshot and restore it (engine/prefix_cache.py,
cuda_runner's snapshots) and capture the decode graphs over its buffers.
"""
from __future__ import annotations

import numpy as np

from ninfer_numba.config import ModelConfig
from ninfer_numba.kernels import position
from ninfer_numba.kernels.kvq.ref import KV_TYPES
from ninfer_numba.kernels.numba_env import cuda


def kvq_cache_shapes(kv_type: str, Hkv: int, max_seq: int, d: int):
    """(shape, dtype) of a coded layer's k codes, k norms (float16 bits), v codes, v norms."""
    k_bits, v_bits = KV_TYPES[kv_type]
    return [((Hkv, max_seq, d * k_bits // 8), np.uint8), ((Hkv, max_seq), np.uint16),
            ((Hkv, max_seq, d * v_bits // 8), np.uint8), ((Hkv, max_seq), np.uint16)]


class SequenceState:
    """Device memory of one sequence: KV caches, GDN conv and recurrent states, position counters.

    kv_type f16: one [Hkv, max_seq, d] float16 cache per attention layer. A coded type (k3v3 ...,
    kernels/kvq): per layer the codes and float16 norms of keys and values; every layer's k_cache / v_cache
    is then one shared float16 scratch, where the QK-norm + RoPE kernel leaves the new rows before they are
    coded and where a prefill decodes the layer's cached rows for the f16 attention kernel."""

    def __init__(self, c: ModelConfig, max_seq: int, stream, kv_type: str = "f16", layers: range | None = None) -> None:
        self.max_seq = max_seq
        self.k_cache, self.v_cache, self.conv, self.ssm = {}, {}, {}, {}
        self.kvq: dict[int, tuple] = {}               # layer -> (k codes, k norms, v codes, v norms)
        rows = (c.n_head_kv, max_seq, c.head_dim)
        f16_rows = lambda: cuda.device_array(rows, np.float16, stream=stream)  # noqa: E731
        scratch = (f16_rows(), f16_rows()) if kv_type in KV_TYPES else None
        for i in range(c.n_layer) if layers is None else layers:    # a shard's state holds its layers only
            if c.is_attention_layer(i) and scratch is not None:
                self.k_cache[i], self.v_cache[i] = scratch
                self.kvq[i] = tuple(cuda.device_array(shape, dt, stream=stream) for shape, dt in
                                    kvq_cache_shapes(kv_type, c.n_head_kv, max_seq, c.head_dim))
            elif c.is_attention_layer(i):
                # [Hkv, max_seq, d] float16: each KV head's rows contiguous for the decode kernel's reads
                self.k_cache[i], self.v_cache[i] = f16_rows(), f16_rows()
            else:
                self.conv[i] = cuda.device_array((c.conv_kernel - 1, c.conv_dim), np.float32, stream=stream)
                self.ssm[i] = cuda.device_array((c.ssm_heads, c.ssm_state, c.ssm_state), np.float32, stream=stream)
        self.pos = cuda.device_array(1, np.int32, stream=stream)        # tokens already in the caches
        self.kv_len = cuda.device_array(1, np.int32, stream=stream)     # pos + tokens of this forward
        self.host_pos = 0

    def reset(self, stream) -> None:
        """Zero the recurrent states and the position (KV rows beyond the position are never read)."""
        for a in list(self.conv.values()) + list(self.ssm.values()):
            position.fill_zero(a.reshape(-1), stream=stream)
        position.set_position(self.pos, 0, stream=stream)
        self.host_pos = 0
