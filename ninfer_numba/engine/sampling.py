"""Host-side token selection for the CPU backend: penalties, temperature, top-k, top-p, min-p, seeded.

Penalty windows follow vLLM: presence and frequency penalties count generated tokens only; the repetition
penalty (llama.cpp's rule: positive logits divided, negative multiplied) applies to every token seen in the
prompt or the output. Greedy (temperature 0) takes the lowest index among equal maxima.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ninfer_numba.config import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, n_vocab: int, prompt_ids: Sequence[int] = ()) -> None:
        self.p = params
        self.counts = np.zeros(n_vocab, np.int32)          # generated-token counts
        self.seen = np.zeros(n_vocab, bool)                # prompt or generated
        self.seen[np.asarray(prompt_ids, dtype=np.int64)] = True
        self.rng = np.random.default_rng(params.seed)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with no penalty: the choice is the argmax of the raw logits."""
        p = self.p
        return p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        p = self.p
        x = logits.astype(np.float32, copy=True)
        if p.repetition_penalty != 1.0:
            m = self.seen
            x[m] = np.where(x[m] > 0, x[m] / p.repetition_penalty, x[m] * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            x -= p.presence_penalty * (self.counts > 0) + p.frequency_penalty * self.counts
        return x

    def pick(self, logits: np.ndarray) -> int:
        x = self._penalised(np.asarray(logits).reshape(-1))
        tok = int(np.argmax(x)) if self.p.greedy else self._sample(x)
        self.counts[tok] += 1
        self.seen[tok] = True
        return tok

    def _sample(self, x: np.ndarray) -> int:
        p = self.p
        x = x.astype(np.float64) / p.temperature
        order = np.argsort(-x, kind="stable")              # descending, ties by index
        if p.top_k:
            order = order[: p.top_k]
        probs = np.exp(x[order] - x[order[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, probs = order[:keep], probs[:keep]
        if p.min_p > 0.0:
            m = probs >= p.min_p * probs[0]
            order, probs = order[m], probs[m]
        probs /= probs.sum()
        return int(order[min(int(np.searchsorted(np.cumsum(probs), self.rng.random(), side="right")),
                             len(order) - 1)])
