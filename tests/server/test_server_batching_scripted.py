"""The batched path on the scripted engine (its replies in the scheduler's slots, tests/server/scripted_llm.py):
reasoning, tool calls, stop strings and limits come out of a shared step exactly as from a request alone;
other requests run alone between the steps, never beside them; the waiting line still ends in 429; an engine
failure fails the batch's requests and the server goes on."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.helpers import join_chat_stream, message_of, wait_for
from tests.server.scripted_llm import Reply, ScriptedLLM
from tests.server.test_server_endpoints import TOOL_REPLY, WEATHER_TOOL

MODEL = "scripted-qwen35"
SLOW = 0.01              # seconds per token (per step on the batched path), so the requests overlap
CASES = {
    "reasoning": (Reply("Reasoning 𝔘 here.\n</think>\n\nContent 𝔘 here.", SLOW), {}),
    "tool-call": (Reply(TOOL_REPLY, SLOW), {"tools": [WEATHER_TOOL]}),
    "stop-string": (Reply("</think>\n\nalpha beta<END>gamma STOP delta", SLOW), {"stop": ["<END>", "STOP"]}),
    "length": (Reply("</think>\n\none two three four five six seven", SLOW), {"max_tokens": 6}),
    "no-thinking": (Reply("Plain 毕 answer with 𝔘𝔘.", SLOW),
                    {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}),
}


@pytest.fixture(scope="module")
def engine(qwen_tokenizer) -> ScriptedLLM:
    llm = ScriptedLLM(qwen_tokenizer)
    for key, (reply, _) in CASES.items():
        llm.replies[key] = reply
    return llm


def chat(server, key: str, stream: bool, **extra) -> dict:
    body = dict(model=MODEL, messages=[{"role": "user", "content": key}], temperature=0, **{**CASES[key][1], **extra})
    client = server.client()
    if stream:
        out = join_chat_stream(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **body))
        usage = out.pop("usage")
    else:
        r = client.chat.completions.create(**body)
        out, usage = message_of(r), r.usage
    for call in out["calls"]:
        assert call.pop("id").startswith("call_")
    return {**{k: out[k] for k in ("reasoning", "content", "calls", "finish_reason")},
            "usage": (usage.prompt_tokens, usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens)}




def test_shared_steps_give_what_a_request_alone_gets(serve_llm, engine):
    alone = serve_llm(engine, batch_slots=1)
    batched = serve_llm(engine, batch_slots=4)
    keys = [(k, s) for k in CASES for s in (True, False)]                  # ten requests, four slots
    want = [chat(alone, k, s) for k, s in keys]
    n_prompts = len(engine.slots.prompts)
    with ThreadPoolExecutor(len(keys)) as pool:
        got = list(pool.map(lambda ks: chat(batched, *ks), keys))
    assert got == want
    assert want[2]["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris 𝔘", "days": 2}'}]
    assert [w["content"] for w in want[4:8:2]] == ["alpha beta", "one two three four"]
    assert len(engine.slots.prompts) - n_prompts == len(keys) and max(engine.slots.batch_sizes) == 4
    assert batched.app.state.server.worker.batched.scheduler.retired == {"stop": 8, "length": 2}


def test_other_requests_run_alone_between_the_steps(serve_llm, engine):
    """Two slow greedy streams hold the slots; a sampled request (temperature 1) is answered while they go on,
    and no step ran while it did."""
    server = serve_llm(engine, batch_slots=2)
    engine.replies["slow greedy"] = Reply("</think>\n\n" + "word " * 150, SLOW)
    busy, seen_busy = [], []
    slots = engine.slots
    step = slots.step

    def watched(s, tokens):
        with engine._lock:                     # a single-path stream is open while the batch steps?
            seen_busy.append(engine._active)
        return step(s, tokens)
    slots.step = watched
    try:
        with ThreadPoolExecutor(2) as pool:
            greedy = [pool.submit(server.client().chat.completions.create, model=MODEL, temperature=0,
                                  messages=[{"role": "user", "content": "slow greedy"}]) for _ in range(2)]
            assert wait_for(lambda: len(slots.batch_sizes) > 3 and slots.batch_sizes[-1] == 2, timeout=10.0)
            r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "sampled"}])
            busy.append(all(not f.done() for f in greedy))
            answers = [f.result().choices[0].message.content for f in greedy]
    finally:
        slots.step = step
    assert r.choices[0].message.content == "You said: sampled" and engine.calls[-1][1].temperature == 1.0
    assert busy == [True] and answers == ["word " * 150] * 2
    assert seen_busy and not any(seen_busy)


def test_a_full_line_answers_429_with_batching(serve_llm, engine):
    """Two slots and max_queue 1: two greedy requests decode, a third waits for a slot, a fourth is refused."""
    server = serve_llm(engine, batch_slots=2, max_queue=1)
    engine.replies["hold a slot"] = Reply("</think>\n\n" + "word " * 100, SLOW)
    body = {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "hold a slot"}]}
    state = server.app.state.server
    url = server.url + "/v1/chat/completions"
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(httpx.post, url, json=body, timeout=30) for _ in range(2)]
        assert wait_for(lambda: len(state.worker.batched.scheduler.active) == 2, timeout=10.0)
        waiting = pool.submit(httpx.post, url, json=body, timeout=30)
        assert wait_for(lambda: state.worker.queued == 1, timeout=10.0)
        refused = httpx.post(url, json=body, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert [f.result().status_code for f in held + [waiting]] == [200] * 3


def test_an_engine_failure_fails_the_batch_and_the_server_goes_on(serve_llm, engine):
    server = serve_llm(engine, batch_slots=2)
    engine.replies["explode in a batch"] = Reply("</think>\n\nabout to fail " * 5, SLOW, fail_at=6)
    client = server.client()
    body = dict(model=MODEL, temperature=0, messages=[{"role": "user", "content": "explode in a batch"}])
    with pytest.raises(openai.APIError, match="scripted engine failure"):
        list(client.chat.completions.create(stream=True, **body))
    with pytest.raises(openai.InternalServerError, match="scripted engine failure"):
        client.chat.completions.create(**body)
    r = client.chat.completions.create(model=MODEL, temperature=0, messages=[{"role": "user", "content": "fine"}])
    assert r.choices[0].message.content == "You said: fine"
    assert not server.app.state.server.worker.batched.busy


def test_stopping_the_worker_reports_where_the_batched_time_went(qwen_tokenizer, capsys):
    """GenerationWorker.stop prints the batched path's one-line account (steps, rows, prefills and the output
    side's seconds) for the operator, after the requests it held have finished."""
    import asyncio

    from ninfer_numba.config import SamplingParams
    from ninfer_numba.server.output_parser import ChatOutputParser
    from ninfer_numba.server.worker import Finished, GenerationWorker, Job
    llm = ScriptedLLM(qwen_tokenizer)
    loop = asyncio.new_event_loop()
    worker = GenerationWorker(llm, batch_slots=2)
    job = Job(qwen_tokenizer.encode("hi"), SamplingParams(max_tokens=8, temperature=0.0), [],
              ChatOutputParser(start_in_reasoning=False), loop)
    worker.submit(job)
    worker.stop()
    loop.run_until_complete(asyncio.sleep(0))          # the posted events land in the job's queue
    events = []
    while not job.events.empty():
        events.append(job.events.get_nowait())
    loop.close()
    assert isinstance(events[-1], Finished)
    err = capsys.readouterr().err
    assert "ninfer serve: batched decode: " in err and "1 prefills in" in err and "text and events" in err


def test_the_worker_shortens_the_gil_switch_interval(qwen_tokenizer):
    """The worker must get the GIL back the moment a step ends (server/worker.py SWITCH_INTERVAL_S): it
    lowers CPython's 5 ms switch interval, and keeps a smaller one set by the embedding program."""
    import sys

    from ninfer_numba.server.worker import SWITCH_INTERVAL_S, GenerationWorker
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(5e-3)
        GenerationWorker(ScriptedLLM(qwen_tokenizer), batch_slots=2).stop()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        sys.setswitchinterval(1e-4)
        GenerationWorker(ScriptedLLM(qwen_tokenizer), batch_slots=1).stop()
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    finally:
        sys.setswitchinterval(before)


def test_queued_counts_only_the_jobs_that_will_wait(qwen_tokenizer):
    """The 429 count: a greedy job a free slot will seat, or the first other job when none runs alone, is
    not waiting even before the worker thread picks it up (two requests arriving together at a server with
    free slots were once refused)."""
    import asyncio

    from ninfer_numba.config import SamplingParams
    from ninfer_numba.server.output_parser import ChatOutputParser
    from ninfer_numba.server.worker import GenerationWorker, Job
    loop = asyncio.new_event_loop()
    worker = GenerationWorker(ScriptedLLM(qwen_tokenizer), batch_slots=2)
    worker.stop()                                   # the line below is never picked up

    def job(temperature: float) -> Job:
        return Job(qwen_tokenizer.encode("hi"), SamplingParams(max_tokens=8, temperature=temperature), [],
                   ChatOutputParser(start_in_reasoning=False), loop)
    try:
        counts = []
        for temperature in (0.0, 0.0, 0.0, 1.0, 1.0, 0.0):
            worker._line.append(job(temperature))
            counts.append(worker.queued)
        assert counts == [0, 0, 1, 1, 2, 3]         # two slots for the greedy jobs, one place to run alone
        worker._alone_places, worker._slot_places = 0, -1   # a job runs alone; one sequence waits for a slot
        assert worker.queued == (4 + 1) + 2
    finally:
        loop.close()


def test_an_idle_worker_admits_requests_that_arrive_together_at_once(qwen_tokenizer):
    """Three greedy requests whose handlers began together (worker.arriving()) are submitted 10 ms apart: the
    idle batched worker waits for them (server/worker.py ADMIT_WAIT_S), so its first step already holds all
    three, where it would have started on the first alone; a request that never finishes arriving holds the
    others back ADMIT_WAIT_S at most."""
    import asyncio
    import time

    from ninfer_numba.config import SamplingParams
    from ninfer_numba.server.output_parser import ChatOutputParser
    from ninfer_numba.server.worker import ADMIT_WAIT_S, GenerationWorker, Job
    loop = asyncio.new_event_loop()
    worker = GenerationWorker(ScriptedLLM(qwen_tokenizer), batch_slots=4)
    sched = worker.batched.scheduler
    first_step = []                                 # (sequences it held, when it ran)
    real_step = sched.step

    def step():
        if not first_step:
            first_step.append((len(sched.waiting) + len(sched.active), time.perf_counter()))
        return real_step()
    sched.step = step

    def job() -> Job:
        return Job(qwen_tokenizer.encode("hi"), SamplingParams(max_tokens=4, temperature=0.0), [],
                   ChatOutputParser(start_in_reasoning=False), loop)
    try:
        handlers = [worker.arriving() for _ in range(3)]
        for h in handlers:
            h.__enter__()
        for h in handlers:
            worker.submit(job())
            h.__exit__(None, None, None)
            time.sleep(0.01)
        deadline = time.monotonic() + 5
        while sched.busy or not first_step:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert first_step[0][0] == 3
        first_step.clear()
        stuck = worker.arriving()                   # a client that never finishes sending its request
        stuck.__enter__()
        t0 = time.perf_counter()
        worker.submit(job())
        while not first_step:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert first_step[0][0] == 1 and first_step[0][1] - t0 >= 0.9 * ADMIT_WAIT_S
        stuck.__exit__(None, None, None)
    finally:
        worker.stop()
        loop.close()
