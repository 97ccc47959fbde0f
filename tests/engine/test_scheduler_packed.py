"""engine/scheduler.Scheduler with a decoder that packs prompts (prefill_many): who is packed, in what order,
within what room, with the prefix cache; every sequence's tokens as when it runs alone."""
from __future__ import annotations

import types

from ninfer_numba.engine.prefix_cache import PrefixCache
from ninfer_numba.engine.scheduler import PACK_MIN, Scheduler, Sequence
from tests.engine.test_scheduler import RecordingSlots, alone


class PackingSlots(RecordingSlots):
    """RecordingSlots that also prefills several slots in one call, and keeps snapshots of what a slot was fed."""

    def __init__(self, n_slots: int, max_seq: int = 64, room: tuple[int, int] = (16, 32)):
        super().__init__(n_slots, max_seq)
        self.pack_room = room

    def prefill_many(self, items):
        self.calls.append(("prefill_many", tuple((s, len(ids)) for s, ids in items)))
        for s, ids in items:
            self.fed[s] += ids
        return [self._pick(s) for s, _ in items]

    def snapshot(self, s):
        return types.SimpleNamespace(fed=list(self.fed[s]), nbytes=1)

    def restore(self, s, snap):
        self.calls.append(("restore", s, len(snap.fed)))
        self.fed[s] = list(snap.fed)


def _run(sched):
    while sched.busy:
        sched.step()


def test_waiting_prompts_are_packed_into_one_prefill():
    dec = PackingSlots(4)
    sched = Scheduler(dec)
    seqs = [Sequence([i + 1, 2, 3, 4][: 2 + i % 3], max_tokens=3 + i) for i in range(4)]
    for q in seqs:
        sched.add(q)
    made = sched.step()
    assert dec.calls[0] == ("prefill_many", ((0, 2), (1, 3), (2, 4), (3, 2)))
    assert [q for q, _ in made][:4] == seqs and sched.counts["prefills"] == 4
    assert sched.counts["packs"] == 1 and sched.counts["packed"] == 4
    assert "4 prefills in" in sched.summary() and "(4 of them in 1 packed forwards," in sched.summary()
    assert "s enqueueing the forwards, " in sched.summary() and "s their snapshots)" in sched.summary()
    assert dec.calls[1] == ("step", (0, 1, 2, 3))
    _run(sched)
    for q in seqs:
        assert q.generated == alone(q.prompt_ids, q.max_tokens), q


def test_fewer_than_pack_min_go_one_at_a_time():
    dec = PackingSlots(4)
    sched = Scheduler(dec)
    for i in range(PACK_MIN - 1):
        sched.add(Sequence([i + 1, 5], max_tokens=2))
    sched.step()
    assert dec.calls[0] == ("prefill", 0, 2) and not any(c[0] == "prefill_many" for c in dec.calls)


def test_a_pack_stops_at_its_room_and_keeps_the_line_in_order():
    """room: 3 sequences or 10 tokens at most; 5 waiting with 4, 4, 4, 1, 1 tokens: the first two fit the
    tokens (8, a third would be 12): fewer than PACK_MIN, so the first goes alone; then 4, 4, 1 pack (9)."""
    dec = PackingSlots(5, room=(3, 10))
    sched = Scheduler(dec)
    seqs = [Sequence([i + 1] * n, max_tokens=5) for i, n in enumerate((4, 4, 4, 1, 1))]
    for q in seqs:
        sched.add(q)
    sched.step()
    assert dec.calls[0] == ("prefill", 0, 4)
    sched.step()
    assert ("prefill_many", ((1, 4), (2, 4), (3, 1))) in dec.calls
    _run(sched)
    for q in seqs:
        assert q.generated == alone(q.prompt_ids, q.max_tokens), q


def test_packed_prompts_restore_their_cached_prefix_and_are_kept():
    """A cached prefix is restored into the slot and only the rest packed (cached_tokens); a prompt whose
    rest needs a snapshot cut ends the pack; each packed prompt's whole state is kept."""
    dec = PackingSlots(4)
    cache = PrefixCache(budget_bytes=100, every=8)
    sched = Scheduler(dec, cache)
    base = [9, 8, 7, 6, 5, 4, 3, 2]
    cache.put(base, types.SimpleNamespace(fed=list(base), nbytes=1))
    seqs = [Sequence(base + [1, 1], 2), Sequence([3, 3, 3], 2), Sequence(base + [2], 2),
            Sequence([1] * 12, 2)]                                  # 12 tokens from 0: a cut at 8
    for q in seqs:
        sched.add(q)
    sched.step()
    packed = [c for c in dec.calls if c[0] == "prefill_many"]
    assert packed == [("prefill_many", ((0, 2), (1, 3), (2, 1)))]
    assert [q.cached_tokens for q in seqs[:3]] == [8, 0, 8]
    assert ("restore", 0, 8) in dec.calls and ("restore", 2, 8) in dec.calls
    assert all(cache.has(q.prompt_ids) for q in seqs[:3]) and seqs[3].slot is None
    assert cache.hits == 2 and cache.misses == 1                 # peeking counts nothing
    _run(sched)
    for q in seqs:
        assert q.generated == alone(q.prompt_ids, q.max_tokens), q


def test_packing_off_admits_one_per_step():
    dec = PackingSlots(4)
    sched = Scheduler(dec, pack=False)
    for i in range(4):
        sched.add(Sequence([i + 1, 5], max_tokens=2))
    sched.step()
    assert dec.calls[0] == ("prefill", 0, 2) and not any(c[0] == "prefill_many" for c in dec.calls)


def test_the_engine_flag_reaches_the_scheduler():
    from ninfer_numba.config import EngineConfig
    assert EngineConfig().pack_prompts is True
    from ninfer_numba.cli import _engine_kwargs, build_parser
    a = build_parser().parse_args(["serve", "--model", "m.gguf", "--no-pack-prompts"])
    assert _engine_kwargs(a)["pack_prompts"] is False
    assert _engine_kwargs(build_parser().parse_args(["serve", "--model", "m.gguf"]))["pack_prompts"] is True
