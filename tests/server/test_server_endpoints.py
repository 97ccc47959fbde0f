"""Every endpoint through the real `openai` client (and httpx for the non-OpenAI ones) on a live server."""
from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import join_chat_stream, message_of
from tests.server.scripted_llm import Reply

MODEL = "scripted-qwen35"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}
TOOL_REPLY = ("Need the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
              "<parameter=city>\nParis 𝔘\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


def test_health_and_models(live, client):
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_response_and_usage(client, scripted, qwen_tokenizer):
    reply = "Some reasoning 𝔘.\n</think>\n\nThe answer: 毕老师 𝔘!"
    scripted.replies["usage?"] = Reply(reply)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "usage?"}])
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, msg.role) == ("Some reasoning 𝔘.", "The answer: 毕老师 𝔘!", "assistant")
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion" and r.model == MODEL
    prompt, _ = scripted.calls[-1]
    reply_ids = qwen_tokenizer.encode(reply)
    assert r.usage.prompt_tokens == len(qwen_tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(reply_ids) + 1           # + <|im_end|>
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    think_end = reply_ids.index(qwen_tokenizer.token_id("</think>"))
    assert r.usage.completion_tokens_details.reasoning_tokens == think_end + 1


@pytest.mark.parametrize("reply,extra", [
    ("Reasoning 𝔘 here.\n</think>\n\nContent 𝔘 here.", {}),
    (TOOL_REPLY, {"tools": [WEATHER_TOOL]}),
    ("Plain 毕 answer with 𝔘𝔘.", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}),
    ("Cut short 𝔘 by the limit and then some more", {"max_tokens": 6}),
], ids=["reasoning", "tool-call", "no-thinking", "length"])
def test_stream_equals_non_stream(client, scripted, reply, extra):
    key = f"same? {reply[:12]}"
    scripted.replies[key] = Reply(reply)
    body = dict(model=MODEL, messages=[{"role": "user", "content": key}], seed=3, **extra)
    whole = message_of(client.chat.completions.create(**body))
    streamed = join_chat_stream(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **body))
    for call in whole["calls"] + streamed["calls"]:
        assert call.pop("id").startswith("call_")
    for field in ("reasoning", "content", "calls", "finish_reason"):
        assert streamed[field] == whole[field], field
    assert streamed["usage"] is not None and streamed["usage"].completion_tokens > 0
    if "tools" in extra:
        assert whole["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris 𝔘", "days": 2}'}]
        assert whole["finish_reason"] == "tool_calls" and whole["content"] == "Let me check."


def test_usage_chunk_only_when_asked(client):
    messages = [{"role": "user", "content": "no usage please"}]
    plain = join_chat_stream(client.chat.completions.create(model=MODEL, messages=messages, stream=True))
    empty_options = join_chat_stream(client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={}))
    assert plain["usage"] is None and empty_options["usage"] is None
    assert plain["content"] == "You said: no usage please"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, scripted, stream):
    scripted.replies["stop?"] = Reply("</think>\n\nalpha beta<END>gamma STOP delta")
    body = dict(model=MODEL, messages=[{"role": "user", "content": "stop?"}], stop=["STOP", "<END>"])
    if stream:
        out = join_chat_stream(client.chat.completions.create(stream=True, **body))
    else:
        out = message_of(client.chat.completions.create(**body))
    assert out["content"] == "alpha beta" and out["finish_reason"] == "stop"
    single = message_of(client.chat.completions.create(**{**body, "stop": "gamma"}))
    assert single["content"] == "alpha beta<END>"


def test_max_tokens_gives_length(client, scripted):
    scripted.replies["long?"] = Reply("</think>\n\none two three four five six seven")
    for field in ("max_tokens", "max_completion_tokens"):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long?"}],
                                           **{field: 4})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
        assert scripted.calls[-1][1].max_tokens == 4


def test_sampling_parameters_reach_the_engine(client, scripted):
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "params"}], temperature=0.3, top_p=0.9, seed=7,
        presence_penalty=1.5, frequency_penalty=-0.5, max_tokens=50,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    params = scripted.calls[-1][1]
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0.3, 0.9, 20, 0.05, 7)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (1.5, -0.5, 1.1)
    assert params.max_tokens == 50


def test_ignore_eos_and_stop_token_ids(client, scripted, qwen_tokenizer):
    """vLLM's extra parameters: ignore_eos runs past the end-of-turn token to max_tokens; stop_token_ids end
    the reply at an id of the caller's choosing (one rule for the engine and the server: SamplingParams)."""
    reply = "</think>\n\nred green blue"
    scripted.replies["eos?"] = Reply(reply)
    n_reply = len(qwen_tokenizer.encode(reply))
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "eos?"}])
    r = client.chat.completions.create(**ask, max_tokens=n_reply + 1)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "red green blue"
    r = client.chat.completions.create(**ask, max_tokens=n_reply + 1, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n_reply + 1
    assert scripted.calls[-1][1].ignore_eos
    green = qwen_tokenizer.encode(" green")
    assert len(green) == 1
    r = client.chat.completions.create(**ask, extra_body={"stop_token_ids": green})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "red"
    assert scripted.calls[-1][1].stop_token_ids == tuple(green)


@pytest.mark.parametrize("ids", [[-1], [10 ** 9]], ids=["negative", "past-vocab"])
def test_stop_token_ids_out_of_range(live, ids):
    r = httpx.post(live.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop_token_ids": ids}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


def test_no_think_switch(client, scripted):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Quick one /no_think"}])
    prompt, _ = scripted.calls[-1]
    assert prompt.endswith("<|im_start|>user\nQuick one<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert r.choices[0].message.content == "You said: Quick one"


def test_tool_call_round_trip(client, scripted):
    scripted.replies["Weather in Paris?"] = Reply(TOOL_REPLY)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    call = r.choices[0].message.tool_calls[0]
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    scripted.replies['<tool_response>\n{"temp": 21}\n</tool_response>'] = Reply("</think>\n\nIt is 21 degrees.")
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert final.choices[0].message.content == "It is 21 degrees."
    prompt, _ = scripted.calls[-1]
    assert "<function=get_weather>\n<parameter=city>\nParis 𝔘\n</parameter>" in prompt


def test_tool_choice_required(client, scripted):
    scripted.replies["call it"] = Reply("<function=get_weather>\n<parameter=days>\n4\n</parameter>\n</function>\n"
                                        "</tool_call>")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "call it"}],
                                       tools=[WEATHER_TOOL], tool_choice="required")
    assert scripted.calls[-1][0].endswith("</think>\n\n<tool_call>\n")
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.arguments == '{"days": 4}'


def test_completions(client, scripted, qwen_tokenizer):
    scripted.replies["Once upon a time"] = Reply(", a model 𝔘 wrote tests. The end.", end_of_turn=False)
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=100)
    assert r.choices[0].text == ", a model 𝔘 wrote tests. The end." and r.choices[0].finish_reason == "length"
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", echo=True, stop=[" wrote"])
    assert echoed.choices[0].text == "Once upon a time, a model 𝔘" and echoed.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    by_ids = client.completions.create(model=MODEL, prompt=qwen_tokenizer.encode("Once upon a time"))
    assert by_ids.choices[0].text == r.choices[0].text


def test_tokenize_and_detokenize(live, qwen_tokenizer):
    text = "Hello 毕老师 <think>"
    tok = httpx.post(live.url + "/tokenize", json={"content": text}).json()
    assert tok["tokens"] == qwen_tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert httpx.post(live.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"content": text}
    pieces = httpx.post(live.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == text
    literal = httpx.post(live.url + "/tokenize", json={"content": "<think>", "parse_special": False}).json()
    assert len(literal["tokens"]) > 1
    chat = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert qwen_tokenizer.decode(chat["tokens"]).endswith("<|im_start|>assistant\n<think>\n")
