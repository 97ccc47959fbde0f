"""Worker events -> OpenAI response bodies and SSE chunks (serving.md §1.4-1.6).

Streaming turns each batch of parser events into chunk deltas; non-streaming feeds the same events to an
accumulator, so the streamed pieces concatenate to the non-streamed message.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ninfer_numba.server.output_parser import REASONING, TextDelta, ToolCallArgs, ToolCallStart
from ninfer_numba.server.worker import Finished, TokenLogprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(done: Finished) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": done.reasoning_tokens}}


class ResponseHeader:
    """The fields every chunk of one response shares."""

    def __init__(self, kind: str, model: str, fingerprint: str, include_usage: bool):
        self.kind = kind                       # "chat" | "text"
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage

    def chunk(self, choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None,
              timings: dict[str, float] | None = None) -> dict[str, Any]:
        """One SSE chunk; the usage chunk also carries the request's timings (worker.JobOutput.timings, in the
        place llama.cpp's server puts its own), a field OpenAI clients keep as an extra."""
        out = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
               "choices": choices}
        if self.include_usage:
            out["usage"] = usage_body
        if timings is not None:
            out["timings"] = timings
        return out

    def body(self, choice: dict[str, Any], done: Finished) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
                "choices": [choice], "usage": usage(done),
                **({"timings": done.timings} if done.timings else {})}


def chat_deltas(events: list[Any]) -> list[dict[str, Any]]:
    """Delta objects for one batch of parser events; adjacent text of one channel is merged."""
    deltas: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, TextDelta):
            key = "reasoning_content" if ev.channel == REASONING else "content"
            if deltas and list(deltas[-1]) == [key]:
                deltas[-1][key] += ev.text
            else:
                deltas.append({key: ev.text})
        elif isinstance(ev, ToolCallStart):
            deltas.append({"tool_calls": [{"index": ev.index, "id": ev.call_id, "type": "function",
                                           "function": {"name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, ToolCallArgs):
            deltas.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
    return deltas


def logprob_entries(events: list[Any]) -> list[dict[str, Any]]:
    """The chat ``logprobs.content`` entries of one batch of events (one per generated token)."""
    return [ev.entry for ev in events if isinstance(ev, TokenLogprobs)]


def completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """Chat logprob entries in the legacy completions shape; text offsets count from ``offset``."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def text_delta(events: list[Any]) -> str:
    return "".join(ev.text for ev in events if isinstance(ev, TextDelta))


class ChatAccumulator:
    """Joins parser events into the non-streaming assistant message."""

    def __init__(self):
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []

    def add(self, events: list[Any]) -> None:
        self.logprobs += logprob_entries(events)
        for ev in events:
            if isinstance(ev, TextDelta):
                (self.reasoning if ev.channel == REASONING else self.content).append(ev.text)
            elif isinstance(ev, ToolCallStart):
                self.calls.append({"id": ev.call_id, "type": "function",
                                   "function": {"name": ev.name, "arguments": ""}})
            elif isinstance(ev, ToolCallArgs):
                self.calls[ev.index]["function"]["arguments"] += ev.fragment

    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None,
                               "refusal": None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg
