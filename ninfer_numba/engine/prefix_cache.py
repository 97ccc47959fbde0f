"""Snapshots of a sequence's state at token prefixes, reused by later requests that start with them.

An attention layer's KV cache can be cut at any token, but a Gated DeltaNet layer's state (conv window and
recurrent matrix) exists only at the position it reached. So a prefix can be resumed only where a snapshot
was taken: LLM.stream takes one at every multiple of ``every`` tokens inside a prompt (by splitting the
prompt's prefill there), one where a chat's history ends (before the generation prompt: the next turn of the
chat renders the answer there and departs from this prompt), and one after the whole prompt, before the
first generated token runs (the prefix a plain continuation starts with). A later prompt restores the longest snapshot that is a proper prefix
of it and prefills the rest: 16 clients sharing a long system prompt prefill it once. The same prompt again
restores its last multiple of ``every``: its last token must run for its logits, and a snapshot one token
short of the end would cost every request a one-token step.

Entries are kept least recently used first within ``budget_bytes``; a snapshot larger than the whole budget
is not kept. What a snapshot holds is the runner's business (``runner.snapshot()`` / ``restore``:
engine/cpu_runner.py, engine/cuda_runner.py); its size is ``snapshot.nbytes``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence


class PrefixCache:
    def __init__(self, budget_bytes: int, every: int) -> None:
        if budget_bytes < 0 or every < 1:
            raise ValueError(f"budget_bytes must be >= 0 and every >= 1 (got {budget_bytes}, {every})")
        self.budget_bytes = budget_bytes
        self.every = every
        self.min_gain = 128        # tokens an extra cut must save to be taken (boundaries)
        self._entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()    # token prefix -> snapshot
        self._lengths: dict[int, int] = {}                                  # prefix length -> entries of it
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def boundaries(self, start: int, n: int, extra: Sequence[int] = ()) -> list[int]:
        """Where to split the prefill of a prompt of n tokens whose first ``start`` are already in the state,
        for a snapshot: the multiples of ``every`` past start and short of n (the whole prompt's own snapshot
        is taken after its prefill), and each of ``extra`` (a chat's system-turn and history lengths) that
        lies between and at least ``min_gain`` tokens past the cut before it. A split costs one more forward
        (a whole weight read, about 2.4 ms on the 9B); a later request saves the prefill of the tokens
        between the cut before and the extra one, which below ~128 would not repay it (9B prefill ~20K
        tokens/s)."""
        cuts = list(range((start // self.every + 1) * self.every, n, self.every))
        for e in sorted(extra):
            if start < e < n and e - max([c for c in cuts if c < e], default=start) >= self.min_gain:
                cuts.append(e)
        return sorted(set(cuts))

    def peek(self, ids: Sequence[int]) -> int:
        """The length longest() would restore (0 for none), without counting a hit or a miss."""
        return next((n for n in sorted(self._lengths, reverse=True)
                     if n < len(ids) and tuple(ids[:n]) in self._entries), 0)

    def longest(self, ids: Sequence[int]) -> tuple[int, Any] | None:
        """(n, snapshot) of the longest cached proper prefix ids[:n] (n < len(ids)), counted as a hit or a miss."""
        for n in sorted(self._lengths, reverse=True):
            if n < len(ids):
                key = tuple(ids[:n])
                snap = self._entries.get(key)
                if snap is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return n, snap
        self.misses += 1
        return None

    def has(self, ids: Sequence[int]) -> bool:
        return tuple(ids) in self._entries

    def keep(self, ids: Sequence[int], take) -> None:
        """put(ids, take()) unless ids are kept already: take (the runner's or a slot's snapshot, a copy of
        the state) runs only when its result is wanted."""
        if not self.has(ids):
            self.put(ids, take())

    def put(self, ids: Sequence[int], snapshot) -> None:
        """Keep ``snapshot`` (the state after ids) unless it alone exceeds the budget; evict the least recently
        used entries until the rest fits."""
        key = tuple(ids)
        if key in self._entries or snapshot.nbytes > self.budget_bytes:
            return
        while self._entries and self.nbytes + snapshot.nbytes > self.budget_bytes:
            old_key, old = self._entries.popitem(last=False)
            self._forget(len(old_key), old)
            self.evictions += 1
        self._entries[key] = snapshot
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.nbytes += snapshot.nbytes

    def clear(self) -> None:
        for key, snap in list(self._entries.items()):
            self._forget(len(key), snap)
        self._entries.clear()

    def _forget(self, n: int, snap) -> None:
        self.nbytes -= snap.nbytes
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.nbytes, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions}
