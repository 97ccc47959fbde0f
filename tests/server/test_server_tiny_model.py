"""Smoke test with the real engine: the tiny synthetic Qwen3.5 model on the CPU backend behind the server."""
from __future__ import annotations

import pytest

from tests.server.helpers import join_chat_stream, message_of

pytest.importorskip("ninfer_numba.synth", reason="ninfer_numba.synth (tiny model writer) is not available")


@pytest.fixture(scope="module")
def tiny_live(serve_llm, tiny_model):
    from ninfer_numba.engine.llm import LLM
    return serve_llm(LLM(tiny_model, backend="cpu", max_seq=256))


def test_tiny_model_chat_and_completions(tiny_live):
    client = tiny_live.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    body = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**body)
    assert whole.usage.completion_tokens <= 8 and whole.usage.prompt_tokens > 0
    assert whole.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = join_chat_stream(client.chat.completions.create(stream=True, **body))
    expected = message_of(whole)
    for field in ("reasoning", "content", "finish_reason"):
        assert streamed[field] == expected[field], field
    text = client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0)
    assert text.usage.completion_tokens <= 4 and text.choices[0].finish_reason in ("stop", "length")
