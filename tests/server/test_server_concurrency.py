"""One generation at a time: concurrent clients are queued, a client that leaves stops its generation, and a
failing request does not take the server down."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.helpers import join_chat_stream, message_of, wait_for
from tests.server.scripted_llm import Reply

MODEL = "scripted-qwen35"
SLOW = Reply("</think>\n\n" + "word " * 400, token_delay_s=0.005)




def test_concurrent_clients_are_served_one_at_a_time(live, scripted):
    def ask(i: int) -> tuple[int, dict]:
        client = live.client()
        body = dict(model=MODEL, messages=[{"role": "user", "content": f"client {i}"}], max_tokens=40)
        if i % 2:
            return i, join_chat_stream(client.chat.completions.create(stream=True, **body))
        return i, message_of(client.chat.completions.create(**body))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    for i, out in results:
        assert out["reasoning"] == f"Thinking about 'client {i}'." and out["content"] == f"You said: client {i}"
    assert scripted.max_active == 1


def test_stream_disconnect_stops_generation(live, scripted):
    scripted.replies["slow stream"] = SLOW
    stream = live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "slow stream"}], stream=True)
    received = [next(iter(stream)) for _ in range(5)]
    assert received[0].choices[0].delta.role == "assistant"
    stream.close()
    assert wait_for(lambda: "slow stream" in scripted.closed_early, timeout=5.0), "the engine generator was not closed"
    assert scripted.wait_idle()
    r = live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "after"}])
    assert r.choices[0].message.content == "You said: after"


def test_non_streaming_disconnect_stops_generation_and_skips_queued_jobs(live, scripted):
    scripted.replies["slow whole"] = SLOW
    scripted.replies["queued then gone"] = Reply("</think>\n\nnever")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "slow whole"}]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=0.5)
    assert wait_for(lambda: "slow whole" in scripted.closed_early, timeout=5.0)

    scripted.replies["blocker"] = SLOW
    blocker = threading.Thread(target=lambda: live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "blocker"}]))
    blocker.start()
    assert wait_for(lambda: any("blocker" in p for p, _ in scripted.calls), timeout=5.0)
    queued = {"model": MODEL, "messages": [{"role": "user", "content": "queued then gone"}]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + "/v1/chat/completions", json=queued, timeout=0.3)
    blocker.join(20)
    assert not blocker.is_alive()
    assert scripted.wait_idle()
    assert not any("queued then gone" in p for p, _ in scripted.calls), "a cancelled queued job still ran"


def test_engine_failure_mid_stream_is_an_error_event(live, scripted, client):
    scripted.replies["explode"] = Reply("</think>\n\nabout to fail " * 5, fail_at=6)   # chat and completions
    body = dict(model=MODEL, messages=[{"role": "user", "content": "explode"}])
    with pytest.raises(openai.APIError, match="scripted engine failure"):
        list(client.chat.completions.create(stream=True, **body))
    with pytest.raises(openai.InternalServerError, match="scripted engine failure"):
        client.chat.completions.create(**body)
    with pytest.raises(openai.APIError, match="scripted engine failure"):
        list(client.completions.create(model=MODEL, prompt="explode", stream=True))
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still alive?"}])
    assert r.choices[0].message.content == "You said: still alive?"


def test_a_full_queue_answers_429_with_retry_after(serve_llm, scripted):
    """max_queue = 1: one request runs, one waits, the next is refused at once with 429 and Retry-After
    (the OpenAI SDK honours it); /health stays fast meanwhile; once the queue drains, requests pass again."""
    server = serve_llm(scripted, max_queue=1)
    scripted.replies["hold the engine"] = Reply("</think>\n\n" + "word " * 200, token_delay_s=0.01)
    body = lambda text: {"model": MODEL, "messages": [{"role": "user", "content": text}]}  # noqa: E731
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=body("hold the engine"),
                              timeout=30)
        assert wait_for(lambda: any("hold the engine" in prompt for prompt, _ in scripted.calls), timeout=5.0)
        waiting = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=body("next in line"),
                              timeout=30)
        assert wait_for(lambda: server.app.state.server.worker.queued == 1, timeout=5.0)
        t0 = time.monotonic()
        refused = httpx.post(server.url + "/v1/chat/completions", json=body("one too many"), timeout=30)
        assert time.monotonic() - t0 < 1.0 and refused.status_code == 429
        assert refused.headers["retry-after"] == "2" and refused.json()["error"]["code"] == "queue_full"
        with httpx.Client() as probe:                # made first: building a client costs ~80 ms of its own
            t0 = time.monotonic()
            assert probe.get(server.url + "/health").status_code == 200 and time.monotonic() - t0 < 0.05
        assert running.result().status_code == 200 and waiting.result().status_code == 200
    assert httpx.post(server.url + "/v1/chat/completions", json=body("after"), timeout=30).status_code == 200


def test_default_max_tokens_caps_a_request_without_one(serve_llm, scripted):
    server = serve_llm(scripted, default_max_tokens=5)
    scripted.replies["long answer"] = Reply("</think>\n\n" + "word " * 50)
    out = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long answer"}])
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
