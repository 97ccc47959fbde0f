"""Malformed requests get 400 (401, 404) in OpenAI's error shape, never a 500 or a hang; the API key."""
from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "scripted-qwen35"
USER = [{"role": "user", "content": "Hi"}]


def post(live, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(live.url + path, content=body, headers={"content-type": "application/json"},
                          timeout=10, **kwargs)
    return httpx.post(live.url + path, json=body, timeout=10, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


CHAT_CASES = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": USER, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "max_tokens": -5}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    ({"model": MODEL, "messages": USER, "temperature": 2.5}, 400, "temperature"),
    ({"model": MODEL, "messages": USER, "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": USER, "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "messages": USER, "presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": MODEL, "messages": USER, "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": USER, "stop": 5}, 400, "stop"),
    ({"model": MODEL, "messages": USER, "n": 2}, 400, "n"),
    ({"model": MODEL, "messages": USER, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": USER, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format.json_schema.schema"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, 400, "response_format"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "json_object"}, "ignore_eos": True}, 400,
     "ignore_eos"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}, 400, "messages[0].content[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ({"model": "gpt-4", "messages": USER}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", CHAT_CASES, ids=[f"{i}-{status}" for i, (_, status, _) in
                                                               enumerate(CHAT_CASES)])
def test_bad_chat_requests(live, body, status, param):
    error = assert_openai_error(post(live, "/v1/chat/completions", body), status, param)
    if status == 404:
        assert error["code"] == "model_not_found"


def test_accepted_extras_and_model_aliases(live):
    body = {"messages": USER, "user": "u1", "store": False, "metadata": {"a": "b"}, "response_format":
            {"type": "text"}, "n": 1, "some_future_field": [1, 2], "max_tokens": 5}
    for model in (None, MODEL, MODEL + ".gguf"):
        r = post(live, "/v1/chat/completions", {**body, **({"model": model} if model else {})})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10 ** 9]}, "prompt"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": 2, "echo": True}, "echo"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 600}, "max_tokens"),
    ({"model": MODEL}, "prompt"),
])
def test_bad_completion_requests(live, body, param):
    assert_openai_error(post(live, "/v1/completions", body), 400, param)


def test_bad_tokenizer_requests_and_unknown_paths(live):
    assert_openai_error(post(live, "/detokenize", {"tokens": [-1]}), 400, "tokens")
    assert_openai_error(post(live, "/detokenize", {"tokens": "abc"}), 400, "tokens")
    assert_openai_error(post(live, "/tokenize", {}), 400)
    assert_openai_error(httpx.get(live.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(live.url + "/v1/chat/completions"), 405)
    assert_openai_error(httpx.get(live.url + "/v1/models/other"), 404, "model")


def test_sdk_raises_the_right_errors(client):
    with pytest.raises(openai.BadRequestError, match="vision projector"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=USER)
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3).usage.completion_tokens == 3


def test_api_key(serve_llm, scripted):
    secured = serve_llm(scripted, api_key="sekret", model_id="alias")
    assert httpx.get(secured.url + "/health").status_code == 200
    assert_openai_error(httpx.get(secured.url + "/v1/models"), 401)
    assert_openai_error(httpx.get(secured.url + "/v1/models", headers={"authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        secured.client(api_key="wrong").models.list()
    good = secured.client(api_key="sekret")
    assert [m.id for m in good.models.list().data] == ["alias"]
    r = good.chat.completions.create(model="alias", messages=USER, max_tokens=2)
    assert r.model == "alias"
    assert good.chat.completions.create(model=scripted.model_id, messages=USER, max_tokens=2).model == "alias"


def test_oversized_deep_and_broken_bodies_are_refused_fast(live):
    """A 20 MB body is refused (413) from its Content-Length in well under a second while /health answers;
    a chunked oversized body is refused as it streams; JSON nested 100,000 deep is a 400, not a 500."""
    import threading
    import time

    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (20 << 20) + b'"}]}'
    health: list[float] = []

    def poll():
        for _ in range(20):
            t0 = time.perf_counter()
            httpx.get(live.url + "/health", timeout=5)
            health.append(time.perf_counter() - t0)
    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.perf_counter()
    r = post(live, "/v1/chat/completions", big)
    took = time.perf_counter() - t0
    poller.join()
    assert_openai_error(r, 413)
    assert took < 1.0, took
    assert max(health) < 0.5, max(health)

    def chunks():
        for _ in range(40):
            yield b" " * (1 << 20)
    r = httpx.post(live.url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=10)
    assert_openai_error(r, 413)
    assert_openai_error(post(live, "/v1/chat/completions", b"[" * 100000 + b"]" * 100000), 400)
