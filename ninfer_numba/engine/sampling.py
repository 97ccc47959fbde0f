"""Token selection state of one request: penalty windows, the seeded draw counter, and the host pick.

Penalty windows follow vLLM: presence and frequency penalties count generated tokens only; the repetition
penalty (llama.cpp's rule: positive logits divided, negative multiplied) applies to every token seen in the
prompt or the output. Greedy (temperature 0) takes the lowest index among equal maxima.

The arithmetic is that of kernels/sample/ref.py, which the device sampler (kernels/sample/device.py) implements
step for step, and draw number n of a request is philox_uniform(seed, n) on both sides: the CPU backend and
the device sampler choose the same token from the same logits. The device kernels read one penalty window;
``device_window`` gives it whenever that single window reproduces the two above (always, unless both a
repetition penalty and a presence/frequency penalty are set), and None otherwise: the host then picks.

A grammar (``constraint``, engine/constraint.py) sets every token it forbids to -inf before the pick and
advances on the chosen one; the device sampler does the same from the packed mask (``mask_words``), one step
at a time. ``logprobs`` records each chosen token's log-probability under the model (the log-softmax of the
raw logits, before penalties, temperature and grammar, as vLLM reports them) with the ``logprobs`` most likely
alternatives; the cuda runner computes the same on the device (kernels/sample/logprobs.py).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ninfer_numba.config import SamplingParams
from ninfer_numba.kernels.sample.ref import apply_mask_ref, apply_penalties_ref, philox_uniform, sample_ref


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]     # the most likely tokens at this step, best first: (id, logprob)


def token_logprob(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """Log-softmax of ``logits`` [V] (float64 arithmetic) at ``token``, and its ``n_top`` best entries."""
    x = np.asarray(logits, np.float64).reshape(-1)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: tuple[tuple[int, float], ...] = ()
    if n_top:
        n = min(n_top, x.shape[0])
        kth = np.partition(x, x.shape[0] - n)[x.shape[0] - n]   # the n-th largest logit
        above = np.flatnonzero(x > kth)
        idx = np.concatenate([above, np.flatnonzero(x == kth)[:n - above.shape[0]]])   # ties: the lower ids
        idx = idx[np.lexsort((idx, -x[idx]))]                # by logit, ties by the lower id
        top = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(int(token), float(x[token] - lse), top)


class Sampler:
    def __init__(self, params: SamplingParams, n_vocab: int, prompt_ids: Sequence[int] = (),
                 constraint=None) -> None:
        self.p = params
        self.constraint = constraint                        # allowed() -> bool [V], advance(token), or None
        self.logprob_log: list[TokenLogprob] = []           # one entry per pick when params.logprobs is set
        self.seed = int(params.seed) & (2 ** 64 - 1) if params.seed is not None else secrets.randbits(64)
        self.step = 0                                       # draws so far (the philox counter)
        self.counts = np.zeros(n_vocab, np.int32)           # [V] generated-token counts
        self.seen = np.zeros(n_vocab, np.int32)             # [V] 1 where seen in the prompt or the output
        self.seen[np.asarray(prompt_ids, dtype=np.int64)] = 1

    @property
    def has_repetition(self) -> bool:
        return self.p.repetition_penalty != 1.0

    @property
    def has_presence_frequency(self) -> bool:
        return bool(self.p.presence_penalty or self.p.frequency_penalty)

    def mask_words(self, n_vocab: int) -> np.ndarray:
        """The grammar's allowed set for the next draw, packed (int32 [ceil(V/32)], constraint.bitmask)."""
        return self.constraint.bitmask(n_vocab)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with no penalty: the choice is the argmax of the raw logits."""
        return self.p.is_plain_greedy

    def device_window(self) -> np.ndarray | None:
        """[V] int32 counts for the device kernels' single penalty window, or None when no single one fits."""
        if self.has_repetition and self.has_presence_frequency:
            return None
        return (self.seen if self.has_repetition else self.counts).copy()

    def device_params(self) -> dict:
        """Keyword arguments of kernels.sample.pack_sample_params for the next draw."""
        p = self.p
        return dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                    repetition=p.repetition_penalty, presence=p.presence_penalty,
                    frequency=p.frequency_penalty, seed=self.seed, step=self.step,
                    masked=self.constraint is not None)

    def penalised(self, logits: np.ndarray) -> np.ndarray:
        p = self.p
        x = np.asarray(logits, np.float32).reshape(-1)
        if self.has_repetition:
            x = apply_penalties_ref(x, self.seen, repetition=p.repetition_penalty)
        if self.has_presence_frequency:
            x = apply_penalties_ref(x, self.counts, presence=p.presence_penalty, frequency=p.frequency_penalty)
        return x

    def choose(self, logits: np.ndarray, mask: np.ndarray | None = None) -> int:
        """The draw from ``logits`` [V] under the packed mask (mask_words) when given; nothing is recorded."""
        p = self.p
        x = self.penalised(logits)
        if mask is not None:
            x = apply_mask_ref(x, mask)
        return sample_ref(x, p.temperature, p.top_k, p.top_p, p.min_p, philox_uniform(self.seed, self.step))

    def pick(self, logits: np.ndarray) -> int:
        """Choose from ``logits`` [V] on the host, under the grammar, and record the choice."""
        mask = self.mask_words(np.asarray(logits).size) if self.constraint is not None else None
        tok = self.choose(logits, mask)
        if self.p.logprobs is not None:
            self.logprob_log.append(token_logprob(logits, tok, self.p.logprobs))
        self.accept(tok)
        return tok

    def accept(self, tok: int) -> None:
        """Account for a token chosen here or on the device: the grammar advances on it, the counts see it."""
        if self.constraint is not None:
            self.constraint.advance(tok)
        self.record(tok)

    def record(self, tok: int) -> None:
        """The draw counter and the penalty windows see tok."""
        self.step += 1
        self.counts[tok] += 1
        self.seen[tok] = 1
