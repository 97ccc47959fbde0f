"""Joining streamed OpenAI chunks back into one message, checking the stream's shape on the way; waiting for a
server-side condition; a free port for a server in a subprocess."""
from __future__ import annotations

import socket
import time
from typing import Any, Iterable


def join_chat_stream(chunks: Iterable[Any]) -> dict[str, Any]:
    """Concatenates reasoning, content and tool-call deltas; asserts OpenAI's chunk ordering rules."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": [], "finish_reason": None, "usage": None,
                           "ids": set(), "n_chunks": 0}
    chunks = list(chunks)
    assert chunks, "empty stream"
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and not first.content
    for chunk in chunks:
        out["ids"].add(chunk.id)
        out["n_chunks"] += 1
        if not chunk.choices:   # the usage chunk: last, and only with include_usage
            assert chunk is chunks[-1] and chunk.usage is not None
            out["usage"] = chunk.usage
            continue
        assert out["finish_reason"] is None, "a chunk after finish_reason"
        choice = chunk.choices[0]
        delta = choice.delta
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        out["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(out["calls"]):
                assert call.id and call.type == "function" and call.function.name
                assert call.function.arguments == ""
                out["calls"].append({"id": call.id, "name": call.function.name, "arguments": ""})
            else:
                assert call.id is None and call.function.name is None
                out["calls"][call.index]["arguments"] += call.function.arguments
        out["finish_reason"] = choice.finish_reason
    assert len(out["ids"]) == 1
    return out


def message_of(response) -> dict[str, Any]:
    msg = response.choices[0].message
    return {"reasoning": getattr(msg, "reasoning_content", None) or "", "content": msg.content or "",
            "calls": [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                      for c in msg.tool_calls or []],
            "finish_reason": response.choices[0].finish_reason}


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll predicate() until it is true (True) or timeout seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def free_port() -> int:
    """A port the OS has just handed out on 127.0.0.1 (for a server started by the code under test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
