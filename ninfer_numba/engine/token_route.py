"""The one route from a prompt to generated tokens, for every backend (LLM.stream runs it).

Every runner is driven through the same sampling calls, those of the cuda runner's device sampler:

    start_sampling(window, params)   the request's penalty window ([V] int32) and settings, before sampled picks
    start_logprobs(n_top)            each pick also makes a record that last_logprob(token) returns
    prefill_sampled(ids, mask=None, logprobs=False, sampled=True) -> int
                                     run the prompt, pick the first token (sampled=False: the argmax)
    decode_sampled(token, mask=None, logprobs=False) -> int
                                     one sampled step under a grammar's packed mask (or a function giving it)
    run_ahead(first, sampled=False, logprobs=False) -> Iterator[int]
                                     steps from ``first``, each fed its own pick, as long as the caller reads

A runner that draws on the device (``supports_device_sampling``) answers them itself when its single penalty
window holds the request (engine/sampling.py) and, with logprobs, when it computes them too. Otherwise
``HostPicks`` answers them over the runner's logits copied back, with the request's Sampler: the NumPy
reference arithmetic the device kernels implement (kernels/sample/ref.py). The cpu runner always goes through
HostPicks; the route below is the same for both.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Iterator

import numpy as np

from ninfer_numba.engine.sampling import Sampler, token_logprob


class HostPicks:
    """The sampling calls answered on the host from ``runner``'s logits (prefill, decode, decode_greedy) with
    ``sampler``'s arithmetic, both penalty windows included. The route accounts for each token (accept), as it
    does for the device's picks; the draws here only read the sampler's counter and windows."""

    def __init__(self, runner, sampler: Sampler) -> None:
        self.runner, self.sampler = runner, sampler
        self.n_top = 0
        self._record = None

    def start_sampling(self, window: np.ndarray, params: dict) -> None:
        """Nothing to load: the sampler holds the windows and settings."""

    def start_logprobs(self, n_top: int) -> None:
        self.n_top = n_top

    def last_logprob(self, token: int):
        assert self._record is not None and self._record.token == token, "no record of this token"
        return self._record

    def _pick(self, logits: np.ndarray, mask, logprobs: bool, sampled: bool) -> int:
        mask = mask() if callable(mask) else mask
        tok = self.sampler.choose(logits, mask) if sampled else int(np.argmax(logits))
        if logprobs:
            self._record = token_logprob(logits, tok, self.n_top)
        return tok

    def prefill_sampled(self, ids: list[int], mask=None, logprobs: bool = False, sampled: bool = True) -> int:
        return self._pick(self.runner.prefill(ids), mask, logprobs, sampled)

    def decode_sampled(self, token: int, mask=None, logprobs: bool = False) -> int:
        return self._pick(self.runner.decode(token), mask, logprobs, True)

    def run_ahead(self, first: int, sampled: bool = False, logprobs: bool = False) -> Iterator[int]:
        """Each step's pick fed to the next; plain argmax steps without records read back only the token
        (decode_greedy: the device argmax on a GPU runner)."""
        tok = first
        while True:
            if sampled or logprobs:
                tok = self._pick(self.runner.decode(tok), None, logprobs, sampled)
            else:
                tok = self.runner.decode_greedy(tok)
            yield tok


def picker_for(runner, sampler: Sampler, window: np.ndarray | None):
    """The runner itself when its device sampler can draw this request (window: sampler.device_window()),
    else HostPicks over it."""
    wants_logprobs = sampler.p.logprobs is not None
    if getattr(runner, "supports_device_sampling", False) and window is not None and (
            not wants_logprobs or getattr(runner, "supports_device_logprobs", False)):
        return runner
    return HostPicks(runner, sampler)


def token_steps(runner, sampler: Sampler, ids: list[int], n_vocab: int,
                prefilled: Callable[[], None] = lambda: None) -> Iterator[int]:
    """Run ``ids`` from the runner's current state and yield the tokens picked after them, each fed back as
    the next step's input, for as long as the caller reads; ``prefilled()`` runs once ids have run, before any
    generated token does. Under a grammar each step waits for its token (the next mask needs it); otherwise
    run_ahead keeps one step in flight. Every token is accounted in the sampler (grammar, counts, draw
    counter) and, with logprobs, its record appended to ``sampler.logprob_log``."""
    window = sampler.device_window()
    picks = picker_for(runner, sampler, window)
    logprobs = sampler.p.logprobs is not None
    sampled = sampler.constraint is not None or not sampler.is_plain_greedy
    mask = partial(sampler.mask_words, n_vocab) if sampler.constraint is not None else None
    if logprobs:
        picks.start_logprobs(sampler.p.logprobs)
    if sampled:
        picks.start_sampling(window, sampler.device_params())

    def accepted(tok: int) -> int:
        if logprobs:
            sampler.logprob_log.append(picks.last_logprob(tok))
        sampler.accept(tok)
        return tok

    tok = accepted(picks.prefill_sampled(ids, mask=mask, logprobs=logprobs, sampled=sampled))
    prefilled()
    yield tok
    if mask is None:
        for tok in picks.run_ahead(tok, sampled=sampled, logprobs=logprobs):
            yield accepted(tok)
        return           # run_ahead ends only when the context is full
    while True:          # under the grammar: one step at a time
        tok = accepted(picks.decode_sampled(tok, mask=mask, logprobs=logprobs))
        yield tok
