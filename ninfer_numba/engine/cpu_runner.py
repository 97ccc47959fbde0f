"""The ``cpu`` backend on the NumPy reference model: CpuRunner runs one sequence; CpuSlots holds the slots of
the scheduler (engine/scheduler.py) and steps them one after another."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ninfer_numba.model.reference import ReferenceModel, ReferenceState
from ninfer_numba.model.weights import ModelWeights


@dataclass(frozen=True)
class CpuSnapshot:
    """The state after ``pos`` tokens: KV rows < pos and the GDN states, copied (engine/prefix_cache.py)."""
    pos: int
    k: dict
    v: dict
    conv: dict
    ssm: dict
    nbytes: int


def snapshot_state(st: ReferenceState) -> CpuSnapshot:
    p = st.pos
    parts = [{i: a[:p].copy() for i, a in st.k_cache.items()}, {i: a[:p].copy() for i, a in st.v_cache.items()},
             {i: a.copy() for i, a in st.conv.items()}, {i: a.copy() for i, a in st.ssm.items()}]
    return CpuSnapshot(p, *parts, nbytes=sum(a.nbytes for d in parts for a in d.values()))


def restore_state(model: ReferenceModel, max_seq: int, snap: CpuSnapshot) -> ReferenceState:
    st = model.new_state(max_seq)
    st.pos = snap.pos
    for i in snap.k:
        st.k_cache[i][:snap.pos] = snap.k[i]
        st.v_cache[i][:snap.pos] = snap.v[i]
    for i in snap.conv:
        st.conv[i][...] = snap.conv[i]
        st.ssm[i][...] = snap.ssm[i]
    return st


class CpuRunner:
    compile_seconds = 0.0

    def __init__(self, weights: ModelWeights, max_seq: int, *, emulate_int8: bool = False,
                 kv_type: str = "f16", weight_cache_bytes: int = 0) -> None:
        """weight_cache_bytes: float32 matrices kept dequantized across forwards (model/weights.DequantCache);
        without, every forward dequantizes every matrix again: on the tiny model with the real vocabulary the
        tied 248,320-row head alone is ~0.1 s of each decode step."""
        self.model = ReferenceModel(weights, emulate_int8=emulate_int8, kv_type=kv_type,
                                    weight_cache_bytes=weight_cache_bytes)
        self.max_seq = max_seq
        self.state = self.model.new_state(max_seq)

    def reset(self) -> None:
        self.state = self.model.new_state(self.max_seq)

    def fill_random(self, n: int, seed: int = 0) -> None:
        """The sequence at depth n without a prefill (ReferenceState.fill_random): for timing at depth."""
        self.state.fill_random(n, seed)

    @property
    def position(self) -> int:
        """Tokens the state holds."""
        return self.state.pos

    def snapshot(self) -> CpuSnapshot:
        return snapshot_state(self.state)

    def restore(self, snap: CpuSnapshot) -> None:
        self.state = restore_state(self.model, self.max_seq, snap)

    def prefill(self, ids: list[int]) -> np.ndarray:
        """Run the prompt; returns the last position's logits [V]."""
        return self.model.forward(ids, self.state, all_logits=False)[0]

    def decode(self, token: int) -> np.ndarray:
        return self.model.forward([token], self.state, all_logits=False)[0]

    def decode_greedy(self, token: int) -> int:
        return int(np.argmax(self.decode(token)))

    def all_logits(self, ids: list[int]) -> np.ndarray:
        return self.model.forward(ids, self.state, all_logits=True).astype(np.float32)

    def timed_prefill(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.prefill(ids)
        return time.perf_counter() - t0

    def timed_decode(self, first: int, n_gen: int) -> float:
        """n_gen greedy steps, each feeding back the argmax (the host reads every token, as llama-bench does)."""
        tok = first
        t0 = time.perf_counter()
        for _ in range(n_gen):
            tok = int(np.argmax(self.decode(tok)))
        return time.perf_counter() - t0


class CpuSlots:
    """n_slots sequences on one reference model, a slot decoder for engine/scheduler.py: each slot its own
    ReferenceState, allocated when a sequence enters and dropped when it leaves. The NumPy model has no
    batched forward, so a step runs the slots one after another; each pick is the argmax of the slot's logits,
    as CpuRunner.decode_greedy and the host's greedy pick, so a sequence's tokens equal LLM.stream's."""

    def __init__(self, model: ReferenceModel, n_slots: int, max_seq: int) -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, not {n_slots}")
        self.model, self.n_slots, self.max_seq = model, n_slots, max_seq
        self.states: list[ReferenceState | None] = [None] * n_slots

    def reset(self, s: int) -> None:
        self.states[s] = self.model.new_state(self.max_seq)

    def restore(self, s: int, snap: CpuSnapshot) -> None:
        self.states[s] = restore_state(self.model, self.max_seq, snap)

    def snapshot(self, s: int) -> CpuSnapshot:
        return snapshot_state(self.states[s])

    def release(self, s: int) -> None:
        self.states[s] = None

    def prefill(self, s: int, ids: list[int]) -> int:
        return int(np.argmax(self.model.forward(ids, self.states[s], all_logits=False)[0]))

    def step(self, slots: list[int], tokens: list[int]) -> list[int]:
        if len(slots) != len(tokens) or len(set(slots)) != len(slots):
            raise ValueError(f"distinct slots and one token each, got slots {slots} and tokens {tokens}")
        return [self.prefill(s, [t]) for s, t in zip(slots, tokens)]

    def launch(self, slots: list[int], tokens: list[int]) -> None:
        """step() in the two halves the scheduler overlaps on the GPU (engine/batched.py); here it runs at once."""
        self._picks = self.step(slots, tokens)

    def collect(self) -> list[int]:
        picks, self._picks = self._picks, None
        return picks
