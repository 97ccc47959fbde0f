"""engine/scheduler.Scheduler: admission, interleaved prefill, retirement and cancellation on a recording slot
decoder; then on the CPU backend (CpuSlots, the tiny model), token for token against LLM.stream's greedy."""
from __future__ import annotations

import pytest

from ninfer_numba import LLM, SamplingParams
from ninfer_numba.engine.scheduler import Scheduler, Sequence


class RecordingSlots:
    """A slot decoder whose next token is a hash of everything its slot was fed (so a slot stepped with another
    sequence's token, or not emptied, answers differently), recording each call."""

    def __init__(self, n_slots: int, max_seq: int = 64):
        self.n_slots, self.max_seq = n_slots, max_seq
        self.fed: list[list[int] | None] = [None] * n_slots
        self.calls: list[tuple] = []

    def reset(self, s):
        self.fed[s] = []

    def release(self, s):
        self.calls.append(("release", s))
        self.fed[s] = None

    def prefill(self, s, ids):
        self.calls.append(("prefill", s, len(ids)))
        self.fed[s] += ids
        return self._pick(s)

    def step(self, slots, tokens):
        self.calls.append(("step", tuple(slots)))
        for s, t in zip(slots, tokens):
            self.fed[s].append(t)
        return [self._pick(s) for s in slots]

    def _pick(self, s):
        h = 0
        for t in self.fed[s]:
            h = (h * 31 + t + 7) % 1009
        return h % 50


def alone(prompt, max_tokens, stop=frozenset()):
    """The sequence's tokens when it is the only one."""
    sched = Scheduler(RecordingSlots(1))
    seq = Sequence(prompt, max_tokens, stop)
    sched.add(seq)
    while sched.busy:
        sched.step()
    return seq.generated


def test_admission_waits_for_a_free_slot_and_prefills_between_steps():
    dec = RecordingSlots(2)
    sched = Scheduler(dec)
    seqs = [Sequence([i + 1, 2, 3], max_tokens=m) for i, m in enumerate((4, 6, 4))]
    for q in seqs:
        sched.add(q)
    made = sched.step()
    assert made[0] == (seqs[0], seqs[0].generated[0]) and [q for q, _ in made] == [seqs[0], seqs[0]]
    assert [q.slot for q in seqs] == [0, None, None] and len(sched.waiting) == 2
    sched.step()                                       # the second admitted; the third waits: two slots
    assert [q.slot for q in seqs] == [0, 1, None] and list(sched.waiting) == [seqs[2]]
    assert dec.calls == [("prefill", 0, 3), ("step", (0,)), ("prefill", 1, 3), ("step", (0, 1))]
    sched.step()                                       # seqs[0]'s fourth token: retired, its slot free
    assert seqs[0].finish_reason == "length" and sched.slots[0] is None and seqs[2].slot is None
    assert ("release", 0) in dec.calls
    while sched.busy:
        sched.step()
    assert seqs[2].slot == 0                           # the freed slot
    for q in seqs:
        assert q.generated == alone(q.prompt_ids, q.max_tokens), q
    assert sched.retired == {"length": 3}
    steps = sum(c[0] == "step" for c in dec.calls)
    assert sched.counts["prefills"] == 3 and sched.counts["steps"] == steps
    assert sched.counts["rows"] == sum(len(c[1]) for c in dec.calls if c[0] == "step")
    assert f"{steps} steps of" in sched.summary() and "3 prefills in" in sched.summary()


class LaunchingSlots(RecordingSlots):
    """RecordingSlots with step() in two halves, as the GPU's decoder: launch() feeds the slots, collect()
    hands over the picks (the scheduler's caller works on the tokens in between)."""

    def launch(self, slots, tokens):
        self._picks = RecordingSlots.step(self, slots, tokens)
        self.calls[-1] = ("launch", tuple(slots))         # recorded as a launch, not a step

    def collect(self):
        self.calls.append(("collect",))
        picks, self._picks = self._picks, None
        return picks


def test_launched_steps_are_collected_by_the_next_call():
    """With launch / collect a call returns the tokens of the step the call before launched: the same tokens
    in the end, each sequence's first (its prefill's) at once; a sequence cancelled while its step is out
    loses that token and keeps "cancelled"; the last step is collected while busy says so."""
    dec = LaunchingSlots(2)
    sched = Scheduler(dec)
    a, b = Sequence([1, 2, 3], max_tokens=5), Sequence([4, 5], max_tokens=5)
    sched.add(a)
    sched.add(b)
    made = sched.step()                               # a prefilled (its first token) and launched
    assert made == [(a, a.generated[0])] and dec.calls[-1] == ("launch", (0,))
    made = sched.step()                               # a's second token; b admitted; both launched
    assert [q for q, _ in made] == [a, b] and len(a.generated) == 2 and dec.calls[-1] == ("launch", (0, 1))
    sched.cancel(b)                                   # while its step is out
    made = sched.step()
    assert [q for q, _ in made] == [a] and b.finish_reason == "cancelled" and len(b.generated) == 1
    while sched.busy:
        sched.step()
    assert a.generated == alone(a.prompt_ids, 5) and a.finish_reason == "length"
    assert dec.calls[-2:] == [("collect",), ("release", 0)] and sched.retired == {"length": 1, "cancelled": 1}


def test_stop_token_retires_and_is_the_last_token():
    free = alone([9, 9], 12)
    stop = frozenset({free[4]})
    first = free.index(free[4])                        # the stop id's first appearance
    sched = Scheduler(RecordingSlots(3))
    seq, other = Sequence([9, 9], 12, stop), Sequence([1], 5)
    sched.add(seq)
    sched.add(other)
    while sched.busy:
        sched.step()
    assert seq.generated == free[:first + 1] and seq.finish_reason == "stop"
    assert other.generated == alone([1], 5) and other.finish_reason == "length"


def test_cancel_mid_batch_frees_the_slot_and_leaves_the_others_alone():
    dec = RecordingSlots(2)
    sched = Scheduler(dec)
    a, b, c = Sequence([1, 2], 10), Sequence([3], 10), Sequence([4, 5, 6], 4)
    for q in (a, b, c):
        sched.add(q)
    for _ in range(3):
        sched.step()
    assert a.slot == 0 and b.slot == 1 and c.slot is None
    sched.cancel(a)
    assert a.finish_reason == "cancelled" and sched.slots[0] is None and ("release", 0) in dec.calls
    sched.step()                                       # c takes a's slot at once
    assert c.slot == 0 and dec.calls[-2:] == [("prefill", 0, 3), ("step", (0, 1))]
    while sched.busy:
        sched.step()
    assert len(a.generated) == 4 and a.generated == alone([1, 2], 10)[:4]
    assert b.generated == alone([3], 10) and c.generated == alone([4, 5, 6], 4)
    waiting = Sequence([7], 3)
    sched.add(Sequence([8], 3))
    sched.add(Sequence([8], 3))
    sched.add(waiting)
    sched.step()
    sched.cancel(waiting)                              # still waiting: dropped from the line
    assert waiting not in sched.waiting and waiting.finish_reason == "cancelled" and not waiting.generated
    assert sched.retired["cancelled"] == 2


def test_add_checks_the_slot_has_room():
    sched = Scheduler(RecordingSlots(1, max_seq=8))
    for prompt, n in (([], 3), ([1] * 6, 3), ([1], 0)):
        with pytest.raises(ValueError, match="in slots of 8"):
            sched.add(Sequence(prompt, n))
    sched.add(Sequence([1] * 5, 3))                    # 5 + 3 = 8: the last token is never fed
    assert len(sched.waiting) == 1


def test_abort_retires_the_active_and_keeps_the_waiting():
    sched = Scheduler(RecordingSlots(1))
    a, b = Sequence([1], 5), Sequence([2], 5)
    sched.add(a)
    sched.add(b)
    sched.step()
    assert sched.abort() == [a] and a.finish_reason == "cancelled" and list(sched.waiting) == [b]


def test_a_long_prompt_fills_in_chunks_between_the_others_steps():
    """admit_chunk 4: a 10-token prompt runs in pieces of 4, 4 and 2, one a step, while the sequence already
    decoding keeps getting a token every step; nothing else is admitted meanwhile; both end with the tokens
    they get alone; the prefill count is per sequence, the pieces per forward."""
    dec = RecordingSlots(3)
    sched = Scheduler(dec, admit_chunk=4)
    a, b, c = Sequence([1, 2, 3], 8), Sequence(list(range(10, 20)), 5), Sequence([4], 3)
    sched.add(a)
    sched.step()                                        # a: prefill (3 <= 4: one piece), first step
    sched.add(b)
    sched.add(c)
    made = [sched.step() for _ in range(3)]
    assert dec.calls[2:] == [("prefill", 1, 4), ("step", (0,)), ("prefill", 1, 4), ("step", (0,)),
                             ("prefill", 1, 2), ("step", (0, 1))]
    assert [[q for q, _ in m] for m in made] == [[a], [a], [b, a, b]]
    assert c.slot is None and list(sched.waiting) == [c] and sched.decoding == [a, b]
    while sched.busy:
        sched.step()
    for q in (a, b, c):
        assert q.generated == alone(q.prompt_ids, q.max_tokens), q
    assert sched.counts["prefills"] == 3 and sched.counts["pieces"] == 5


def test_cancelling_a_filling_prompt_frees_its_slot_for_the_next():
    dec = RecordingSlots(1)
    sched = Scheduler(dec, admit_chunk=2)
    long, nxt = Sequence(list(range(1, 8)), 4), Sequence([9, 9], 3)
    sched.add(long)
    sched.add(nxt)
    sched.step()
    assert sched.active == [long] and sched.decoding == [] and not long.generated
    sched.cancel(long)
    assert long.finish_reason == "cancelled" and sched.slots == [None]
    while sched.busy:
        sched.step()
    assert nxt.generated == alone([9, 9], 3) and len(long.generated) == 0
    assert [c for c in dec.calls if c[0] == "prefill"] == [("prefill", 0, 2), ("prefill", 0, 2)]
    with pytest.raises(ValueError, match="admit_chunk"):
        Scheduler(dec, admit_chunk=-1)


# -- the CPU backend: CpuSlots on the tiny model -------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(tiny_model):
    llm = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0)
    texts = ["Hello", "The quick brown fox jumps", "1 2 3", "Once upon a time, in a land far away"]
    return [llm.encode(t) for t in texts]


def test_cpu_slots_equal_the_single_sequence_greedy(tiny_model, prompts):
    """Four prompts in three slots (the fourth waits for the first to finish), lengths 6, 4, 6, 3: every
    sequence's tokens equal LLM.stream's greedy tokens for its prompt alone."""
    single = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0)
    lengths = (6, 4, 6, 3)
    want = [single.generate(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)).token_ids
            for p, n in zip(prompts, lengths)]
    llm = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0)
    sched = llm.scheduler(3)
    seqs = [Sequence(p, n) for p, n in zip(prompts, lengths)]
    for q in seqs:
        sched.add(q)
    widths = []
    while sched.busy:
        sched.step()
        widths.append(len(sched.active))
    assert [q.generated for q in seqs] == want
    assert max(widths) == 3 and seqs[3].slot == seqs[1].slot       # the first slot freed is reused


def test_cpu_slots_fill_long_prompts_in_chunks_with_the_same_tokens(tiny_model, prompts):
    """admit_chunk 3 on the tiny model: prompts of 3 to ~10 tokens prefilled in pieces between the others'
    steps give LLM.stream's greedy tokens, and a snapshot at a prompt's end is kept as without chunks."""
    single = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0)
    want = [single.generate(p, GREEDY).token_ids for p in prompts]
    llm = LLM(tiny_model, backend="cpu", max_seq=128, admit_chunk=3)
    sched = llm.scheduler(2)
    seqs = [Sequence(p, GREEDY.max_tokens, llm.stop_ids(GREEDY)) for p in prompts]
    for q in seqs:
        sched.add(q)
    while sched.busy:
        sched.step()
    assert [q.generated for q in seqs] == want
    assert sched.counts["pieces"] > len(prompts) and all(llm.prefix_cache.has(p) for p in prompts)


def test_cpu_slots_share_the_prefix_cache_with_the_single_path(tiny_model, prompts):
    """A snapshot the single path kept is restored into a slot (cached_tokens), and the slot's tokens equal the
    single path's with the same cache history."""
    base, extended = prompts[1], prompts[1] + prompts[3]
    ref = LLM(tiny_model, backend="cpu", max_seq=128, prefix_reuse=False)
    ref.generate(base, GREEDY)
    want = ref.generate(extended, GREEDY)
    llm = LLM(tiny_model, backend="cpu", max_seq=128, prefix_reuse=False)
    llm.generate(base, GREEDY)
    sched = llm.scheduler(2)
    seq = Sequence(extended, GREEDY.max_tokens, llm.stop_ids(GREEDY))
    sched.add(seq)
    while sched.busy:
        sched.step()
    assert want.cached_tokens == len(base) == seq.cached_tokens
    assert seq.generated == want.token_ids
    assert llm.prefix_cache.has(extended)                              # the slot's own snapshot, kept
