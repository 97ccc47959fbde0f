"""CPU runner: one sequence on the NumPy reference model (the ``cpu`` backend)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ninfer_numba.model.reference import ReferenceModel
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


class CpuRunner:
    compile_seconds = 0.0

    def __init__(self, weights: ModelWeights, max_seq: int, *, emulate_int8: bool = False,
                 kv_type: str = "f16") -> None:
        self.model = ReferenceModel(weights, emulate_int8=emulate_int8, kv_type=kv_type)
        self.max_seq = max_seq
        self.state = self.model.new_state(max_seq)

    def reset(self) -> None:
        self.state = self.model.new_state(self.max_seq)

    @property
    def position(self) -> int:
        """Tokens the state holds."""
        return self.state.pos

    def snapshot(self) -> CpuSnapshot:
        st, p = self.state, self.state.pos
        parts = [{i: a[:p].copy() for i, a in st.k_cache.items()}, {i: a[:p].copy() for i, a in st.v_cache.items()},
                 {i: a.copy() for i, a in st.conv.items()}, {i: a.copy() for i, a in st.ssm.items()}]
        return CpuSnapshot(p, *parts, nbytes=sum(a.nbytes for d in parts for a in d.values()))

    def restore(self, snap: CpuSnapshot) -> None:
        self.state = st = self.model.new_state(self.max_seq)
        st.pos = snap.pos
        for i in snap.k:
            st.k_cache[i][:snap.pos] = snap.k[i]
            st.v_cache[i][:snap.pos] = snap.v[i]
        for i in snap.conv:
            st.conv[i][...] = snap.conv[i]
            st.ssm[i][...] = snap.ssm[i]

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
