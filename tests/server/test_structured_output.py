"""logprobs, forced tool calls and JSON output through the server, with the real engine (the tiny synthetic
Qwen3.5 model on the CPU backend): a random model writes whatever the grammar allows, so every answer being
valid is the grammar's doing. Schemas have bounded values (enums, booleans, bounded integers): a random model
could write an unbounded string forever. The 100-request run of each case is
``python -m benchmarks.e2e.structured_output``; here a few requests each keep `make test` short."""
from __future__ import annotations

import json

import pytest

from benchmarks.e2e.structured_output import ANSWER, LIGHTS, WEATHER, ask, valid_answer, valid_call
from tests.server.helpers import join_chat_stream, message_of

pytest.importorskip("llguidance", reason="llguidance (constrained decoding) is not installed")

@pytest.fixture(scope="module")
def tiny_client(serve_llm, tiny_model):
    from ninfer_numba.engine.llm import LLM
    return serve_llm(LLM(tiny_model, backend="cpu", max_seq=512)).client()


@pytest.mark.parametrize("i", range(3))
def test_json_schema_answers_are_valid(tiny_client, i):
    r = tiny_client.chat.completions.create(
        model="tiny", messages=ask(i), max_tokens=120, temperature=1.0, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert valid_answer(json.loads(r.choices[0].message.content))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_carry_valid_arguments(tiny_client, choice):
    for i in range(2):
        r = tiny_client.chat.completions.create(model="tiny", messages=ask(i), tools=[WEATHER, LIGHTS],
                                                tool_choice=choice, max_tokens=120, temperature=1.0, seed=i)
        msg = message_of(r)
        assert msg["finish_reason"] == "tool_calls" and len(msg["calls"]) == 1, msg
        call = msg["calls"][0]
        assert valid_call(call["name"], json.loads(call["arguments"])), call
        if isinstance(choice, dict):
            assert call["name"] == "get_weather"


def test_json_object_streams_the_same_json(tiny_client):
    body = dict(model="tiny", messages=ask(7), max_tokens=60, temperature=0.0,
                response_format={"type": "json_object"})
    whole = tiny_client.chat.completions.create(**body)
    streamed = join_chat_stream(tiny_client.chat.completions.create(stream=True, **body))
    assert streamed["content"] == whole.choices[0].message.content
    if whole.choices[0].finish_reason == "stop":       # a json_object may run past 60 tokens
        assert isinstance(json.loads(whole.choices[0].message.content), dict)


def test_chat_logprobs_streamed_and_whole(tiny_client):
    body = dict(model="tiny", messages=ask(3), max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=4)
    whole = tiny_client.chat.completions.create(**body)
    entries = whole.choices[0].logprobs.content
    n_text = whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop")
    assert len(entries) == n_text
    for e in entries:
        assert len(e.top_logprobs) == 4 and e.logprob <= 0.0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob   # greedy
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    streamed = [c.choices[0].logprobs.content for c in tiny_client.chat.completions.create(stream=True, **body)
                if c.choices and c.choices[0].logprobs is not None]
    joined = [e for part in streamed for e in part]
    assert [(e.token, e.logprob) for e in joined] == [(e.token, e.logprob) for e in entries]


def test_completion_logprobs_shape(tiny_client):
    r = tiny_client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0.0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    if not any("\ufffd" in t for t in lp.tokens):        # a token may end inside a UTF-8 character
        assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) <= 2 for d in lp.top_logprobs)


def test_serve_warms_up_before_the_first_request(qwen_tokenizer):
    """server.api.warm_up (what serve() runs before listening) leaves the chat template compiled and the
    llguidance tokenizer cached, so a first request does not pay them (the event loop waits meanwhile); an
    engine without an end-of-turn token gets no grammar tokenizer, a broken template only a warning."""
    from types import SimpleNamespace

    from ninfer_numba.engine import constraint
    from ninfer_numba.formats import chat_template
    from ninfer_numba.server.api import warm_up
    constraint._LLTOKENIZERS.pop(qwen_tokenizer, None)
    chat_template._compile.cache_clear()
    warm_up(SimpleNamespace(tokenizer=qwen_tokenizer, chat_template=None))
    assert qwen_tokenizer in constraint._LLTOKENIZERS and chat_template._compile.cache_info().currsize == 1
    warm_up(SimpleNamespace(tokenizer=SimpleNamespace(eos_ids=[], encode=len), chat_template="{{ 1/0 }}"))
