"""The batched path with the real engine (the tiny model on the CPU backend): greedy clients streaming at once
get exactly what each gets alone from a server that runs one request at a time, and a client that leaves
mid-batch frees its slot without disturbing the others."""
from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.helpers import join_chat_stream, wait_for

MODEL = "tiny"
TEXTS = ["Hello", "Name three colours", "2 + 2 =", "Tell me about the sea"]


@pytest.fixture(scope="module")
def servers(serve_llm, tiny_model):
    """The tiny model served twice: every request alone (batch_slots 1), and three slots."""
    from ninfer_numba.engine.llm import LLM
    alone = serve_llm(LLM(tiny_model, backend="cpu", max_seq=256), batch_slots=1)
    batched = serve_llm(LLM(tiny_model, backend="cpu", max_seq=256), batch_slots=3)
    return alone, batched


def scheduler_of(server):
    return server.app.state.server.worker.batched.scheduler


def ask(server, text: str, max_tokens: int) -> dict:
    """A greedy streamed chat that runs to max_tokens (ignore_eos), joined, with its usage."""
    out = join_chat_stream(server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = out.pop("usage")
    return {**{k: out[k] for k in ("reasoning", "content", "calls", "finish_reason")},
            "usage": (usage.prompt_tokens, usage.completion_tokens,
                      usage.completion_tokens_details.reasoning_tokens)}




def test_concurrent_streams_equal_their_single_client_outputs(servers, monkeypatch):
    """Four clients, three slots: the fourth waits for a free slot; each stream equals the one-at-a-time
    server's answer to the same request, and steps did run several sequences at once."""
    alone, batched = servers
    lengths = [7, 5, 8, 6]
    want = [ask(alone, t, n) for t, n in zip(TEXTS, lengths)]
    dec = scheduler_of(batched).decoder
    widths, step = [], dec.step
    monkeypatch.setattr(dec, "step", lambda slots, tokens: widths.append(len(slots)) or step(slots, tokens))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda tn: ask(batched, *tn), zip(TEXTS, lengths)))
    for g, w, n in zip(got, want, lengths):
        assert g == w and w["usage"][1] == n and w["finish_reason"] == "length"
    assert max(widths) == 3


def test_a_client_leaving_mid_batch_frees_its_slot_and_spares_the_others(servers):
    alone, batched = servers
    want = {t: ask(alone, t, 6) for t in TEXTS[1:3]}
    sched = scheduler_of(batched)
    before = Counter(sched.retired)
    results = {}

    def finish(text):
        results[text] = ask(batched, text, 6)

    stream = batched.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "leaving early"}], max_tokens=200, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)                                       # the role chunk: the job is queued
    others = [threading.Thread(target=finish, args=(t,)) for t in want]
    for t in others:
        t.start()
    assert wait_for(lambda: len(sched.active) == 3, timeout=20.0), "the three never shared the slots"
    for _ in range(3):
        next(chunks)
    stream.close()
    assert wait_for(lambda: sched.retired["cancelled"] > before["cancelled"], timeout=20.0)
    for t in others:
        t.join(60)
    assert results == want
    assert sched.retired - before == Counter({"cancelled": 1, "length": 2})
    assert wait_for(lambda: not sched.busy, timeout=20.0)


@pytest.mark.parametrize("which", ["alone", "batched"])
def test_responses_carry_the_request_phases_timings(servers, which):
    """A non-streamed and a streamed (usage chunk) response carry the request's timings in milliseconds,
    on the single-sequence path and the scheduler's: every phase non-negative, the first token's time their
    first three summed."""
    server = dict(zip(("alone", "batched"), servers))[which]
    body = dict(model=MODEL, messages=[{"role": "user", "content": "timings"}], max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True})
    whole = server.client().chat.completions.create(**body)
    last = list(server.client().chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **body))[-1]
    for t in (whole.model_extra["timings"], last.model_extra["timings"]):
        assert set(t) == {"prepare_ms", "queue_ms", "prefill_ms", "decode_ms", "first_token_ms"}
        assert all(v >= 0 for v in t.values()) and t["prefill_ms"] > 0
        assert t["first_token_ms"] == pytest.approx(t["prepare_ms"] + t["queue_ms"] + t["prefill_ms"], abs=0.01)
