"""CPU runner: one sequence on the NumPy reference model (the ``cpu`` backend)."""
from __future__ import annotations

import time

import numpy as np

from ninfer_numba.model.reference import ReferenceModel
from ninfer_numba.model.weights import ModelWeights


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
