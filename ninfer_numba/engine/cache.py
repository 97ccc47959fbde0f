"""A sequence's device state, owned by the engine: KV caches (float16 or coded), GDN conv and recurrent states,
position counters. The GPU model's forward reads and writes it (model/qwen35.py ``forward(t, state)``); the
runners allocate one per sequence (``Qwen35Gpu.new_state``), snapshot and restore it (engine/prefix_cache.py,
cuda_runner's snapshots) and capture the decode graphs over its buffers.
"""
from __future__ import annotations

import numpy as np

from ninfer_numba.config import ModelConfig
from ninfer_numba.kernels import position
from ninfer_numba.kernels.kvq.decode import mma_rows
from ninfer_numba.kernels.kvq.ref import KV_TYPES, vector_bytes
from ninfer_numba.kernels.numba_env import cuda


def kvq_cache_shapes(kv_type: str, Hkv: int, max_seq: int, d: int):
    """(shape, dtype) of a coded layer's k codes, k norms (float16 bits), v codes, v norms: max_seq rows
    rounded up to whole tiles of the mma decode partial (kvq/decode_mma.py copies 16 rows at once)."""
    k_bits, v_bits = KV_TYPES[kv_type]
    rows = mma_rows(max_seq)
    return [((Hkv, rows, d * k_bits // 8), np.uint8), ((Hkv, rows), np.uint16),
            ((Hkv, rows, d * v_bits // 8), np.uint8), ((Hkv, rows), np.uint16)]


def kv_memory_bytes(c: ModelConfig, kv_type: str, max_seq: int) -> int:
    """Bytes of the attention layers' caches of one sequence of max_seq tokens, as SequenceState allocates
    them: f16, [Hkv, max_seq, d] float16 K and V per layer; a coded type, each layer's codes and norms."""
    if kv_type in KV_TYPES:
        max_seq = mma_rows(max_seq)
    vectors = len(c.attention_layers) * c.n_head_kv * max_seq
    return vectors * sum(vector_bytes(kv_type, c.head_dim))


class SequenceState:
    """Device memory of one sequence: KV caches, GDN conv and recurrent states, position counters.

    kv_type f16: one [Hkv, max_seq, d] float16 cache per attention layer (k_cache, v_cache). A coded type
    (k3v3 ..., kernels/kvq): per layer the codes and float16 norms of keys and values (kvq), nothing in
    float16: the QK-norm + RoPE kernel codes a forward's new rows, and attention reads the codes."""

    def __init__(self, c: ModelConfig, max_seq: int, stream, kv_type: str = "f16", layers: range | None = None) -> None:
        self.max_seq, self.head_dim = max_seq, c.head_dim
        self.k_cache, self.v_cache, self.conv, self.ssm = {}, {}, {}, {}
        self.kvq: dict[int, tuple] = {}               # layer -> (k codes, k norms, v codes, v norms)
        rows = (c.n_head_kv, max_seq, c.head_dim)
        f16_rows = lambda: cuda.device_array(rows, np.float16, stream=stream)  # noqa: E731
        for i in range(c.n_layer) if layers is None else layers:    # a shard's state holds its layers only
            if c.is_attention_layer(i) and kv_type in KV_TYPES:
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

    @property
    def attention_layers(self) -> list[int]:
        return sorted([*self.k_cache, *self.kvq])

    def kv_bytes(self) -> int:
        """Bytes of the attention layers' caches, as allocated."""
        arrays = [*self.k_cache.values(), *self.v_cache.values(), *(a for t in self.kvq.values() for a in t)]
        return sum(a.nbytes for a in arrays)

    def fill_random(self, n: int, stream, seed: int = 0) -> None:
        """A sequence at depth n without its prefill: rows < n of every attention cache get random keys and
        values (codes uniform, norms those of unit-variance vectors; float16 unit normals), the position
        becomes n, the GDN states stay as they are. For timing decode at depths whose prefill would take too
        long (benchmarks/e2e/long_context.py): a decode step's work does not depend on the values."""
        if not 0 <= n <= self.max_seq:
            raise ValueError(f"a depth of {n} in a state of {self.max_seq} rows")
        rng = np.random.default_rng(seed)
        made: dict = {}                              # one host block per (shape, dtype), copied to every layer

        def block(a):
            key = (a.shape[2:], a.dtype)
            if key not in made:
                shape = (n, *a.shape[2:])
                if a.dtype == np.uint8:                              # codes
                    made[key] = rng.integers(0, 256, shape, dtype=np.uint8)
                elif a.dtype == np.uint16:                           # norms: float16 bits
                    norms = np.sqrt(self.head_dim) * rng.uniform(0.5, 1.5, shape)
                    made[key] = norms.astype(np.float16).view(np.uint16)
                else:
                    made[key] = rng.standard_normal(shape).astype(np.float16)
            return made[key]
        arrays = [a for i in self.attention_layers for a in self.kvq.get(i) or (self.k_cache[i], self.v_cache[i])]
        for a in arrays if n else ():
            for h in range(a.shape[0]):
                a[h, :n].copy_to_device(block(a), stream=stream)
        position.set_position(self.pos, n, stream=stream)
        self.host_pos = n

    def reset(self, stream) -> None:
        """Zero the recurrent states and the position (KV rows beyond the position are never read)."""
        for a in list(self.conv.values()) + list(self.ssm.values()):
            position.fill_zero(a.reshape(-1), stream=stream)
        position.set_position(self.pos, 0, stream=stream)
        self.host_pos = 0


class SlotStates:
    """Device memory of n_slots sequences for batched decode steps, in the f16 KV format: per attention layer
    K and V slabs [n_slots·Hkv, max_seq, d] (slot s holds heads [s·Hkv, (s+1)·Hkv)), per GDN layer conv
    [n_slots, K-1, C] and recurrent [n_slots, Hv, S, S] slabs, and each slot's position on the host.
    ``rows(B)`` is the batch of B rows a forward steps (one per batch size: each its own captured graph);
    ``view(s)`` is slot s as a SequenceState (the prefill path and snapshots run on it)."""

    def __init__(self, c: ModelConfig, n_slots: int, max_seq: int, stream, layers: range | None = None):
        self.c, self.n_slots, self.max_seq, self.stream = c, n_slots, max_seq, stream
        self.k_cache, self.v_cache, self.conv, self.ssm = {}, {}, {}, {}
        for i in range(c.n_layer) if layers is None else layers:
            if c.is_attention_layer(i):
                rows = (n_slots * c.n_head_kv, max_seq, c.head_dim)
                self.k_cache[i] = cuda.device_array(rows, np.float16, stream=stream)
                self.v_cache[i] = cuda.device_array(rows, np.float16, stream=stream)
            else:
                self.conv[i] = cuda.device_array((n_slots, c.conv_kernel - 1, c.conv_dim), np.float32, stream=stream)
                self.ssm[i] = cuda.device_array((n_slots, c.ssm_heads, c.ssm_state, c.ssm_state), np.float32,
                                                stream=stream)
        self.host_pos = [0] * n_slots
        self._rows: dict[int, SlotRows] = {}
        for s in range(n_slots):                      # device_array is uninitialised: every slot starts empty
            self.reset(s)

    def reset(self, s: int) -> None:
        """Empty slot s for a new sequence: zero its GDN conv and recurrent states and its position (its KV
        rows beyond the position are never read)."""
        for a in list(self.conv.values()) + list(self.ssm.values()):
            position.fill_zero(a[s].reshape(-1), stream=self.stream)
        self.host_pos[s] = 0

    def rows(self, batch: int) -> "SlotRows":
        """The B-row batch over these slots (allocated once per B)."""
        if batch not in self._rows:
            if not 1 <= batch <= self.n_slots:
                raise ValueError(f"a batch of {batch} rows over {self.n_slots} slots")
            self._rows[batch] = SlotRows(self, batch)
        return self._rows[batch]

    def view(self, s: int) -> SequenceState:
        """Slot s as a SequenceState over the slabs' memory, with its own position counters (hand it back
        with ``adopt`` after running it, so the next set_rows starts the slot where it stopped)."""
        st = SequenceState.__new__(SequenceState)
        h = slice(s * self.c.n_head_kv, (s + 1) * self.c.n_head_kv)
        st.max_seq, st.head_dim, st.kvq, st.host_pos = self.max_seq, self.c.head_dim, {}, self.host_pos[s]
        st.k_cache = {i: a[h] for i, a in self.k_cache.items()}
        st.v_cache = {i: a[h] for i, a in self.v_cache.items()}
        st.conv = {i: a[s] for i, a in self.conv.items()}
        st.ssm = {i: a[s] for i, a in self.ssm.items()}
        st.pos = cuda.to_device(np.array([self.host_pos[s]], np.int32), stream=self.stream)
        st.kv_len = cuda.device_array(1, np.int32, stream=self.stream)
        return st

    def adopt(self, s: int, view: SequenceState) -> None:
        """Take the position a view of slot s reached (a prefill on it)."""
        self.host_pos[s] = view.host_pos


class SlotRows:
    """B rows of a batched decode step over SlotStates: the slabs (as a forward reads a state's caches), the
    row -> slot table, positions and kv_len [B], and the decode scratch of B rows sharing the table. One
    captured step serves any set of active slots, written by ``set_rows``."""

    def __init__(self, slots: SlotStates, batch: int):
        from ninfer_numba.kernels.flash_attn.decode import alloc_decode_workspace
        from ninfer_numba.kernels.gdn.recurrent import DecodeSync
        c, stream = slots.c, slots.stream
        self.states, self.batch = slots, batch
        self.k_cache, self.v_cache, self.conv, self.ssm = slots.k_cache, slots.v_cache, slots.conv, slots.ssm
        self.kvq: dict = {}
        self.slots = cuda.to_device(np.arange(batch, dtype=np.int32), stream=stream)      # [B] row -> slot
        self.pos = cuda.to_device(np.zeros(batch, np.int32), stream=stream)               # [B] tokens cached
        self.kv_len = cuda.device_array(batch, np.int32, stream=stream)                   # [B] pos + 1
        ws = alloc_decode_workspace(c.n_head, c.head_dim, batch=batch)
        self.attn_ws = type(ws)(ws.part_o, ws.part_ml, self.slots)                        # rows share slots
        self.gdn_sync = DecodeSync(cuda.to_device(np.zeros((batch, c.ssm_groups), np.int32), stream=stream),
                                   self.slots)
        self.active = list(range(batch))

    def set_rows(self, slots: list[int], pad: int | None = None) -> None:
        """Make row b step slot slots[b] from the position its last forward left (host-side bookkeeping). With
        pad, fewer slots than rows may be given: the rows after them step slot pad (a spare no sequence owns:
        its rows race on its state, which nothing reads; its position is put back by every call)."""
        n = self.states.n_slots
        fill = self.batch - len(slots) if pad is not None else 0
        if (fill < 0 or len(slots) + fill != self.batch or len(set(slots)) != len(slots) or pad in slots
                or not all(0 <= s < n for s in list(slots) + ([pad] if fill else []))):
            raise ValueError(f"{self.batch} rows need as many distinct slots in [0, {n}) (or fewer and a pad "
                             f"slot), got {slots} (pad {pad})")
        rows = list(slots) + [pad] * fill
        stream = self.states.stream
        self.slots.copy_to_device(np.array(rows, np.int32), stream=stream)
        self.pos.copy_to_device(np.array([self.states.host_pos[s] for s in rows], np.int32), stream=stream)
        self.active = list(slots)

    def stepped(self) -> None:
        """Host bookkeeping after a batched forward: every active slot holds one more token."""
        for s in self.active:
            self.states.host_pos[s] += 1
