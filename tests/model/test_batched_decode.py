"""A batched decode step (Qwen35Gpu.forward over SlotStates' rows, issue 17) against one-sequence decode steps.

Three sequences prefilled into slots 2, 0 and 3 of four (through each slot's SequenceState view), then one
forward steps all three rows: each row's logits must match the same sequence's ordinary decode step (the
CUDA runner's graph-replayed path). The block dot products are exact int32 in both (dp4a GEMV, int8 mma
rows); only float32 summation orders differ, so the logits agree to ~1e-6 relative and the greedy tokens
are equal. A second batched step on the rows' own greedy tokens checks that positions advanced per row.
Prompts packed into one forward (prefill_many) are checked the same way, against the runner's tokens.
(GPU-only, as the other whole-model tests: under the simulator this model takes minutes per forward.)
"""
import numpy as np
import pytest

from tests.model.test_gpu_model import SPEC, _tiny_gpu_llm


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.gpu
def test_batched_step_equals_single_steps(tmp_path):
    llm = _tiny_gpu_llm(tmp_path)
    runner, model = llm.runner, llm.runner.model
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, SPEC.n_vocab, n).tolist() for n in (5, 31, 17)]
    slot_of = [2, 0, 3]
    want = []                                   # per sequence: logits of two single decode steps
    for p in prompts:
        runner.reset()
        t0 = int(np.argmax(runner.prefill(p)))
        first = runner.decode(t0)
        second = runner.decode(int(np.argmax(first)))
        want.append((t0, first, second))
    from ninfer_numba.engine.cuda_runner import chunk_lengths
    slots = model.new_slots(4, llm.max_seq)
    for s, p in zip(slot_of, prompts):
        view = slots.view(s)
        at = 0
        for n in chunk_lengths(len(p), model.buf.t_max):      # the runner's pieces: the same sums
            model.buf.tokens[:n].copy_to_device(np.array(p[at:at + n], np.int32), stream=model.stream)
            model.forward(n, view)
            at += n
        slots.adopt(s, view)
    rows = slots.rows(3)
    rows.set_rows(slot_of)
    toks = [w[0] for w in want]
    for step in (1, 2):
        model.buf.tokens[:3].copy_to_device(np.array(toks, np.int32), stream=model.stream)
        model.forward(3, rows, logits_rows=3)
        got = model.logits[:3].copy_to_host(stream=model.stream)
        for r, w in enumerate(want):
            assert _rel(got[r], w[step]) < 1e-4, (step, r, _rel(got[r], w[step]))
            assert int(np.argmax(got[r])) == int(np.argmax(w[step]))
        toks = [int(np.argmax(g)) for g in got]
    assert [slots.host_pos[s] for s in slot_of] == [len(p) + 2 for p in prompts]


@pytest.mark.gpu
def test_batched_decoder_greedy_equals_the_runner(tmp_path):
    """engine/batched.BatchedDecoder: three sequences in slots 2, 0, 3 of four step in bucket 4 (one spare row),
    then two of them in bucket 2 in another order: the second of those steps feeds its picks back without an
    upload, the third follows the runner's own use of the model's buffers (which must be noticed); every token
    equals the runner's own greedy decode."""
    from ninfer_numba.engine.batched import BatchedDecoder
    llm = _tiny_gpu_llm(tmp_path)
    runner = llm.runner
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, SPEC.n_vocab, n).tolist() for n in (5, 31, 17)]
    want = []
    for p in prompts:
        runner.reset()
        seq = [int(np.argmax(runner.prefill(p)))]
        for _ in range(6):
            seq.append(runner.decode_greedy(seq[-1]))
        want.append(seq)
    dec = BatchedDecoder(runner.model, 4, llm.max_seq, runner=runner)   # prefills through the runner's graphs
    assert dec.buckets == [1, 2, 4]
    slot_of = [2, 0, 3]
    for s in slot_of:
        dec.reset(s)
    got = [[dec.prefill(s, p)] for s, p in zip(slot_of, prompts)]
    for _ in range(3):
        for g, t in zip(got, dec.step(slot_of, [g[-1] for g in got])):
            g.append(t)
    for k in range(3):                                  # sequence 1 retired: slots 3 and 2, bucket 2
        if k == 2:                                      # the runner between two steps of the same slots
            runner.reset()
            runner.decode_greedy(int(np.argmax(runner.prefill(prompts[1]))))
        for i, t in zip((2, 0), dec.step([3, 2], [got[2][-1], got[0][-1]])):
            got[i].append(t)
    assert got[0] == want[0] and got[2] == want[2] and got[1] == want[1][:4]
    assert dec.host_pos == [len(prompts[1]) + 3, 0, len(prompts[0]) + 6, len(prompts[2]) + 6]


@pytest.mark.gpu
def test_packed_prefill_equals_the_runner(tmp_path):
    """BatchedDecoder.prefill_many (model.forward_packed): four prompt rests of 5, 11, 9 and 1 tokens in one
    forward on slots 2, 0, 3, 1, the first after a 9-token prefix its slot already holds, the last through
    the one-token mixers: every first token and the greedy steps after it equal the runner's own."""
    from ninfer_numba.engine.batched import BatchedDecoder
    llm = _tiny_gpu_llm(tmp_path)
    runner = llm.runner
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, SPEC.n_vocab, n).tolist() for n in (14, 11, 9, 1)]
    want = []
    for p in prompts:
        runner.reset()
        seq = [int(np.argmax(runner.prefill(p)))]
        for _ in range(3):
            seq.append(runner.decode_greedy(seq[-1]))
        want.append(seq)
    dec = BatchedDecoder(runner.model, 4, llm.max_seq, runner=runner)
    slot_of = [2, 0, 3, 1]
    for s in slot_of:
        dec.reset(s)
    dec.prefill(2, prompts[0][:9])
    firsts = dec.prefill_many([(2, prompts[0][9:])] + [(s, p) for s, p in zip(slot_of[1:], prompts[1:])])
    got = [[t] for t in firsts]
    for _ in range(3):
        for g, t in zip(got, dec.step(slot_of, [g[-1] for g in got])):
            g.append(t)
    assert got == want
    assert [dec.host_pos[s] for s in slot_of] == [len(p) + 3 for p in prompts]
    with pytest.raises(ValueError, match="at most"):
        dec.prefill_many([(0, [1] * 20), (1, [1] * 20)])            # 40 tokens > the 32-row buffers


def run_to_end(sched, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's n greedy tokens through the scheduler, all added at once."""
    from ninfer_numba.engine.scheduler import Sequence
    seqs = [Sequence(p, n) for p in prompts]
    for q in seqs:
        sched.add(q)
    while sched.busy:
        sched.step()
    return [q.generated for q in seqs]


@pytest.mark.gpu
def test_scheduler_on_the_gpu_equals_llm_stream_and_shares_snapshots(tmp_path):
    """LLM.scheduler on the cuda backend (BatchedDecoder slots): four prompts in three slots give LLM.stream's
    greedy tokens; a snapshot the runner kept restores into a slot, and a slot's into the runner, each giving
    the tokens of a twin engine with the same history on the single path."""
    from ninfer_numba import SamplingParams
    from ninfer_numba.engine.scheduler import Sequence
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, SPEC.n_vocab, n).tolist() for n in (5, 31, 17, 40)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = _tiny_gpu_llm(tmp_path, prefix_cache_mb=0)
    want = [llm.generate(p, greedy).token_ids for p in prompts]
    sched = llm.scheduler(3)
    assert run_to_end(sched, prompts, 6) == want

    twin, llm = _tiny_gpu_llm(tmp_path, prefix_reuse=False), _tiny_gpu_llm(tmp_path, prefix_reuse=False)
    a, b = prompts[1], prompts[1] + prompts[0]
    c = b + prompts[2]
    want = [twin.generate(p, greedy) for p in (a, b, c)]
    llm.generate(a, greedy)
    sched = llm.scheduler(2)
    seq = Sequence(b, 6)
    sched.add(seq)
    while sched.busy:
        sched.step()
    got = llm.generate(c, greedy)
    assert (seq.cached_tokens, got.cached_tokens) == (len(a), len(b)) == (want[1].cached_tokens, want[2].cached_tokens)
    assert seq.generated == want[1].token_ids and got.token_ids == want[2].token_ids


@pytest.mark.gpu
def test_scheduler_fills_long_prompts_in_chunks_on_the_gpu(tmp_path):
    """admit_chunk 8 on the cuda backend: prompts prefilled 8 tokens a step (through the decoder's staging
    state, between the other slots' batched steps) give the tokens of the runner prefilling the same pieces
    one after another, then decoding greedily."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, SPEC.n_vocab, n).tolist() for n in (5, 31, 17, 40)]
    llm = _tiny_gpu_llm(tmp_path, prefix_cache_mb=0, admit_chunk=8)
    want = []
    for p in prompts:
        llm.runner.reset()
        for a in range(0, len(p), 8):
            last = llm.runner.prefill(p[a:a + 8])
        toks = [int(np.argmax(last))]
        while len(toks) < 6:
            toks.append(int(np.argmax(llm.runner.decode(toks[-1]))))
        want.append(toks)
    sched = llm.scheduler(3)
    assert run_to_end(sched, prompts, 6) == want
    assert sched.counts["pieces"] == 1 + 4 + 3 + 5 and sched.counts["prefills"] == 4


def test_slot_rows_check_their_slots():
    """set_rows takes B distinct slots in range, or fewer and a pad slot (host-side: no kernel runs)."""
    from types import SimpleNamespace

    from ninfer_numba.engine.cache import SlotRows
    rows = SlotRows.__new__(SlotRows)
    rows.batch, rows.states = 2, SimpleNamespace(n_slots=3)
    for bad in ([0], [0, 0], [1, 3]):
        with pytest.raises(ValueError, match="distinct slots"):
            rows.set_rows(bad)
    for bad, pad in (([0, 1, 2], 2), ([0, 1, 2], 0), ([1], 1), ([0], 3)):
        with pytest.raises(ValueError, match="distinct slots"):
            rows.set_rows(bad, pad=pad)
