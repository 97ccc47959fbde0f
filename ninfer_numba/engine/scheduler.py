"""Continuous batching of greedy sequences over the N slots of a slot decoder.

``Scheduler.step()`` is one round: a sequence that waits is admitted into a free slot and prefilled, which
gives its first token (one per step, so an admission delays the active sequences' next token by one prefill at
most; or, with a decoder that has ``prefill_many``, PACK_MIN or more waiting prompts at once in one packed
forward, which reads the weights once for all of them); then every decoding sequence, the new ones included,
advances one token in one batched step; a sequence
whose token is a stop id or its max_tokens-th is retired and its slot freed. ``cancel`` retires one early (a
client gone; a stop string matched, as "stop"). The scheduler is single-threaded: one thread adds, steps and
cancels. With ``admit_chunk`` > 0 a prompt whose rest is longer than that is prefilled admit_chunk tokens per
step (pieces end at the prefix cache's snapshot cuts too), between the decoding sequences' steps, so a long
prompt slows the others' tokens by one piece's forward a step instead of stalling them for its whole prefill;
no other prompt is admitted until it is done. With 0 the whole prompt runs in the step that admits it.

A slot decoder holds n_slots sequences and picks greedily (the argmax of the raw logits):

    n_slots, max_seq
    reset(s)                       slot s emptied for a new sequence
    prefill(s, ids) -> token       ids run after what slot s holds; the greedy next token
    prefill_many([(s, ids)]) -> tokens, pack_room   optional: several slots' prompts in one forward, and the
                                   (sequences, tokens) one such call takes at most
    step(slots, tokens) -> tokens  tokens[i] fed to slot slots[i] (distinct); each one's greedy next token
    launch(slots, tokens), collect() -> tokens   optional: step() in two halves, the GPU's work between them
    release(s)                     slot s's sequence is done (what it held may be freed)
    snapshot(s), restore(s, snap)  only with a prefix cache: slot s's state out, and a snapshot into slot s

engine/batched.BatchedDecoder steps all slots in one forward on the GPU; engine/cpu_runner.CpuSlots steps
them one after another on the reference model. With a prefix cache (engine/prefix_cache.py, the one the
single-sequence path uses: snapshots are the runner's) admission restores the longest cached prefix of the
prompt and keeps snapshots where LLM.stream keeps them (every ``every`` prompt tokens, the caller's cuts,
the whole prompt).
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

# waiting prompts worth one packed forward: on the 9B (H200) a packed forward runs eagerly, ~60 ms of launches
# plus ~1-2 ms per prompt, where one prompt's rest replays from graphs in ~25 ms (two pieces and two copies)
PACK_MIN = 3


@dataclass(eq=False)
class Sequence:
    """One greedy generation: a prompt, then tokens until a stop id or max_tokens (stop id included)."""
    prompt_ids: list[int]
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    snapshot_at: tuple[int, ...] = ()      # prompt lengths worth a snapshot (server/chat.py cuts)
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0                 # prompt tokens restored from the prefix cache
    admitted_at: float | None = None       # time.perf_counter() when it took a slot (its prefill began)
    finish_reason: str | None = None       # once retired: "stop", "length" or "cancelled"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, decoder: Any, prefix_cache: Any = None, *, pack: bool = True,
                 admit_chunk: int = 0) -> None:
        """pack: admit several waiting prompts in one prefill_many when the decoder has it; admit_chunk: the
        prompt tokens a long admission runs per step, 0 for all at once (LLM.scheduler passes
        EngineConfig.pack_prompts and admit_chunk)."""
        if admit_chunk < 0:
            raise ValueError(f"admit_chunk must be >= 0, not {admit_chunk}")
        self.decoder = decoder
        self.prefix_cache = prefix_cache
        self.admit_chunk = admit_chunk
        self._pack = pack and hasattr(decoder, "prefill_many")
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence | None] = [None] * decoder.n_slots
        self.retired: Counter[str] = Counter()      # finish reasons so far
        # where the time goes (wall seconds on the calling thread): "prefill" (admissions, cache restores and
        # snapshots included; "packed": the part in packed forwards, "pack launches": the host's enqueueing of
        # their forwards (the decoder's last_pack_seconds), "pack snapshots": their snapshots), "step"
        # (the decoder's steps: launches, and the waits in collect); counts: "prefills" (sequences admitted),
        # "packs" (packed forwards), "packed" (sequences admitted by them), "pieces" (prompt forwards of the
        # others), "steps", "rows" (sequences stepped, summed over steps)
        self.seconds: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self._pipelined = hasattr(decoder, "launch")
        self._inflight: list[Sequence] | None = None  # the sequences of the launched, uncollected step
        self._filling: Sequence | None = None          # seated, its prompt prefilled over several steps
        self._fill_at = 0                              # prompt tokens _filling's slot holds
        self._fill_ends: list[int] = []                # where its next pieces end (the last: the prompt's length)
        self._fill_cuts: set[int] = set()              # those of them the prefix cache keeps a snapshot at

    @property
    def active(self) -> list[Sequence]:
        """The seated sequences: decoding, or one whose prompt is still being prefilled."""
        return [q for q in self.slots if q is not None]

    @property
    def decoding(self) -> list[Sequence]:
        """The seated sequences a step advances (all but one still prefilling its prompt)."""
        return [q for q in self.slots if q is not None and q is not self._filling]

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(q is not None for q in self.slots) or self._inflight is not None

    def add(self, seq: Sequence) -> None:
        n, room = len(seq.prompt_ids), self.decoder.max_seq
        if seq.max_tokens < 1 or n < 1 or n + seq.max_tokens > room:
            raise ValueError(f"a prompt of {n} tokens and max_tokens {seq.max_tokens} in slots of {room} "
                             "(both at least 1, together at most the slot)")
        self.waiting.append(seq)

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Retire seq now (freeing its slot) or drop it from the waiting line, with this finish reason (a
        caller that ended the text itself, at a stop string, says "stop"); no-op once it is finished."""
        if seq.finished:
            return
        if seq.slot is None:
            self.waiting.remove(seq)
            seq.finish_reason = reason
            self.retired[reason] += 1
        else:
            self._retire(seq, reason)

    def abort(self) -> list[Sequence]:
        """After a failed step: retire every active sequence (as cancelled) and return them."""
        self._inflight = None
        self._filling = None
        gone = self.active
        for seq in gone:
            self._retire(seq, "cancelled")
        return gone

    def step(self) -> list[tuple[Sequence, int]]:
        """Admit one waiting sequence if a slot is free, then step every active one; (sequence, token) for
        each token made, in order. With a decoder that launches a step and collects it later (launch /
        collect), a call collects the step the call before launched (its tokens come first; a sequence
        retired since, by cancel, loses its token), admits, and launches the next step before returning:
        the caller's work on the tokens (text, streaming) overlaps the GPU's next step."""
        made = []
        t0 = time.perf_counter()
        if self._inflight is not None:
            live, self._inflight = self._inflight, None
            made += [self._emit(q, t) for q, t in zip(live, self.decoder.collect()) if not q.finished]
        t1 = time.perf_counter()
        if self._filling is not None:
            admitted = self._fill()
        elif self.waiting and None in self.slots:
            admitted = self._admit()
        else:
            admitted = []
        made += [self._emit(q, t) for q, t in admitted]
        self.counts["prefills"] += len(admitted)
        t2 = time.perf_counter()
        live = self.decoding
        if live:
            slots, inputs = [q.slot for q in live], [q.generated[-1] for q in live]
            if self._pipelined:
                self.decoder.launch(slots, inputs)
                self._inflight = live
            else:
                made += [self._emit(q, t) for q, t in zip(live, self.decoder.step(slots, inputs))]
            self.counts["steps"] += 1
            self.counts["rows"] += len(live)
        self.seconds["prefill"] += t2 - t1
        self.seconds["step"] += (t1 - t0) + (time.perf_counter() - t2)
        return made

    def summary(self) -> str:
        """One line: steps, mean rows, prefills, and the seconds of each."""
        steps = self.counts["steps"]
        c, sec = self.counts, self.seconds
        packs = (f" ({c['packed']} of them in {c['packs']} packed forwards, {sec['packed']:.3f} s: "
                 f"{sec['pack launches']:.3f} s enqueueing the forwards, {sec['pack snapshots']:.3f} s their "
                 f"snapshots)" if c["packs"] else "")
        return (f"{steps} steps of {c['rows'] / max(steps, 1):.1f} rows on average in "
                f"{sec['step']:.3f} s; {c['prefills']} prefills in {sec['prefill']:.3f} s{packs}")

    def _admit(self) -> list[tuple[Sequence, int]]:
        """Seat waiting sequences and prefill them: the longest run from the front of the line whose prompt
        rests (after their cached prefixes) need no snapshot cut and fit one packed forward, if it holds at
        least PACK_MIN and the decoder packs; else the first one alone. (sequence, first token) each."""
        dec, cache = self.decoder, self.prefix_cache
        pack = []
        free = self.slots.count(None)
        if self._pack and min(len(self.waiting), free) >= PACK_MIN:
            most, room = dec.pack_room
            for seq in self.waiting:
                n = len(seq.prompt_ids)
                start = cache.peek(seq.prompt_ids) if cache is not None else 0
                if (len(pack) == min(most, free) or n - start > room
                        or (cache is not None and cache.boundaries(start, n, seq.snapshot_at))):
                    break
                room -= n - start
                pack.append(seq)
        if len(pack) < PACK_MIN:
            return self._begin_fill(self._seat(self.waiting.popleft()))
        t0 = time.perf_counter()
        starts = [self._start(self._seat(self.waiting.popleft())) for _ in pack]
        tokens = dec.prefill_many([(q.slot, q.prompt_ids[b:]) for q, b in zip(pack, starts)])
        t1 = time.perf_counter()
        self.seconds["pack launches"] += getattr(dec, "last_pack_seconds", (0.0, 0.0))[0]
        if cache is not None:
            for q in pack:
                cache.keep(q.prompt_ids, lambda s=q.slot: dec.snapshot(s))
        self.seconds["pack snapshots"] += time.perf_counter() - t1
        self.counts["packs"] += 1
        self.counts["packed"] += len(pack)
        self.seconds["packed"] += time.perf_counter() - t0
        return list(zip(pack, tokens))

    def _seat(self, seq: Sequence) -> Sequence:
        seq.admitted_at = time.perf_counter()
        seq.slot = self.slots.index(None)
        self.slots[seq.slot] = seq
        return seq

    def _start(self, seq: Sequence) -> int:
        """Slot seq.slot emptied, or holding the longest cached prefix of the prompt; the tokens it holds."""
        dec, s, cache = self.decoder, seq.slot, self.prefix_cache
        hit = cache.longest(seq.prompt_ids) if cache is not None else None
        if hit is None:
            dec.reset(s)
            return 0
        start, snap = hit
        dec.restore(s, snap)
        seq.cached_tokens = start
        return start

    def _begin_fill(self, seq: Sequence) -> list[tuple[Sequence, int]]:
        """Slot seq.slot from the longest cached prefix of the prompt (or empty); the rest of the prompt in
        pieces ending where the cache keeps snapshots and, with admit_chunk, every admit_chunk tokens; then
        the first pieces (_fill)."""
        ids, cache = seq.prompt_ids, self.prefix_cache
        start = self._start(seq)
        cuts = cache.boundaries(start, len(ids), seq.snapshot_at) if cache is not None else []
        grid = range(start + self.admit_chunk, len(ids), self.admit_chunk) if self.admit_chunk else []
        self._filling, self._fill_at = seq, start
        self._fill_ends, self._fill_cuts = sorted(set(cuts) | set(grid) | {len(ids)}), set(cuts) | {len(ids)}
        return self._fill()

    def _fill(self) -> list[tuple[Sequence, int]]:
        """The next piece of the filling prompt (every piece without admit_chunk), snapshots kept at the cuts;
        [(sequence, first token)] once its last piece ran, else []."""
        dec, cache, seq = self.decoder, self.prefix_cache, self._filling
        s, ids = seq.slot, seq.prompt_ids
        while self._fill_ends:
            end = self._fill_ends.pop(0)
            token = dec.prefill(s, ids[self._fill_at:end])
            self._fill_at = end
            self.counts["pieces"] += 1
            if cache is not None and end in self._fill_cuts:
                cache.keep(ids[:end], lambda: dec.snapshot(s))
            if self.admit_chunk and self._fill_ends:
                return []
        self._filling = None
        return [(seq, token)]

    def _emit(self, seq: Sequence, token: int) -> tuple[Sequence, int]:
        seq.generated.append(token)
        if token in seq.stop_ids:
            self._retire(seq, "stop")
        elif len(seq.generated) >= seq.max_tokens:
            self._retire(seq, "length")
        return seq, token

    def _retire(self, seq: Sequence, reason: str) -> None:
        if seq is self._filling:
            self._filling = None
        self.slots[seq.slot] = None
        self.decoder.release(seq.slot)
        seq.finish_reason = reason
        self.retired[reason] += 1
