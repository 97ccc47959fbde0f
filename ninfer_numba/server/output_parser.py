"""Splits generated chat text into reasoning, content and tool calls (Qwen3.5/3.6 format, serving.md §3.5).

The parser is fed text deltas and returns events; streaming sends them as they come and the non-streaming
response joins them, so both carry the same text. Markers (`</think>`, `<tool_call>`, ...) are matched on the
decoded text: a suffix that may be the start of a marker is held back until the next delta decides.

Whitespace next to markers belongs to the format, not the message: newlines before `</think>` and before
`<tool_call>` are dropped, as are newlines at the start of reasoning, after `</think>` and after `</tool_call>`.
Tool-call arguments are streamed as JSON fragments, one per completed `<parameter=...>`; joined they form the
arguments object, converted with the tool's schema (tool_args.py).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from ninfer_numba.server.stop_strings import partial_suffix_len
from ninfer_numba.server.tool_args import convert_parameter, parameter_schema

REASONING, CONTENT, TOOL = "reasoning", "content", "tool"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"


@dataclass(frozen=True, slots=True)
class TextDelta:
    channel: str   # REASONING or CONTENT
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    index: int
    fragment: str


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _Channel:
    """One text channel; drops newlines at its start and holds back trailing ones until text follows."""

    def __init__(self, name: str):
        self.name = name
        self.at_start = True
        self.pending_newlines = ""

    def text(self, text: str) -> list[TextDelta]:
        if self.at_start:
            text = text.lstrip("\n")
            if not text:
                return []
            self.at_start = False
        text = self.pending_newlines + text
        body = text.rstrip("\n")
        self.pending_newlines = text[len(body):]
        return [TextDelta(self.name, body)] if body else []

    def boundary(self) -> None:
        """A marker follows: the held newlines were format, and the next text starts a new span."""
        self.pending_newlines = ""
        self.at_start = True

    def end(self) -> list[TextDelta]:
        held, self.pending_newlines = self.pending_newlines, ""
        return [TextDelta(self.name, held)] if held else []


class ChatOutputParser:
    """State machine REASONING -> CONTENT <-> TOOL over generated text.

    start_in_reasoning: the prompt ends inside an open <think> block.
    tools: the request's tool objects by function name (None: tool calls are not parsed, the text is content).
    start_in_call: the prompt already ends with "<tool_call>\\n" (tool_choice "required"), or with the call header
    of `forced_function` as well (a named tool_choice).
    """

    def __init__(self, *, start_in_reasoning: bool, tools: dict[str, dict[str, Any]] | None = None,
                 start_in_call: bool = False, forced_function: str | None = None):
        self.state = REASONING if start_in_reasoning else CONTENT
        self._tools = tools
        self._reasoning = _Channel(REASONING)
        self._content = _Channel(CONTENT)
        self._buf = ""
        self._may_open_think = not start_in_reasoning   # older templates let the model open <think> itself
        self.tool_calls = 0
        self._phase = ""                                # inside TOOL: header | params | after | raw
        self._call: dict[str, Any] = {}
        self._pending_start: list[Any] = []
        if start_in_call or forced_function:
            self.state = TOOL
            self._phase = "header"
            if forced_function:
                self._pending_start = self._open_call(forced_function)

    # -- public ---------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Any]:
        events, self._pending_start = self._pending_start, []
        self._buf += text
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Any]:
        """End of generation: release held text and close an unfinished call so its arguments stay valid JSON."""
        events, self._pending_start = self._pending_start, []
        buf, self._buf = self._buf, ""
        if self.state == REASONING:
            events += self._reasoning.text(buf) + self._reasoning.end()
        elif self.state == CONTENT:
            events += self._content.text(buf) + self._content.end()
        elif self._phase in ("params", "after"):
            events += self._close_args()
        elif buf.strip():
            events += self._json_call(buf) or (self._content.text(self._raw_call_text(buf)) + self._content.end())
        return events

    # -- states ---------------------------------------------------------------------------------------------
    def _step(self, events: list[Any]) -> bool:
        if self.state == TOOL:
            return self._tool_step(events)
        if self.state == CONTENT and self._may_open_think:
            head = self._buf.lstrip()
            if not head or (THINK_OPEN.startswith(head) and head != THINK_OPEN):
                return False
            self._may_open_think = False
            if head.startswith(THINK_OPEN):
                self._buf = head[len(THINK_OPEN):]
                self.state = REASONING
                return True
        channel = self._reasoning if self.state == REASONING else self._content
        markers = [THINK_CLOSE] if self.state == REASONING else []
        if self._tools is not None:
            markers.append(CALL_OPEN)
        hits = [(self._buf.find(m), m) for m in markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if not hits:
            keep = partial_suffix_len(self._buf, markers)
            cut = len(self._buf) - keep
            events += channel.text(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        index, marker = min(hits)
        events += channel.text(self._buf[:index])
        channel.boundary()
        self._buf = self._buf[index + len(marker):]
        if marker == THINK_CLOSE:
            self.state = CONTENT
        else:
            self.state, self._phase = TOOL, "header"
        return True

    def _tool_step(self, events: list[Any]) -> bool:
        head = self._buf.lstrip()
        if self._phase == "header":
            if head.startswith(FUNC_OPEN):
                end = head.find(">")
                if end < 0:
                    return False
                self._buf = head[end + 1:]
                events += self._open_call(head[len(FUNC_OPEN):end].strip())
                return True
            if not head or FUNC_OPEN.startswith(head):
                return False
            self._phase = "raw"   # not the XML call format: keep the text, decide at </tool_call>
            return True
        if self._phase == "raw":
            end = self._buf.find(CALL_CLOSE)
            if end < 0:
                return False
            body, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE):]
            events += self._json_call(body) or self._content.text(self._raw_call_text(body) + CALL_CLOSE)
            self._leave_call()
            return True
        return self._params_step(head, events)

    def _params_step(self, head: str, events: list[Any]) -> bool:
        if self._phase == "params" and head.startswith(PARAM_OPEN):
            name_end = head.find(">")
            if name_end < 0:
                return False
            rest = head[name_end + 1:]
            ends = [(rest.find(m), m) for m in (PARAM_CLOSE, FUNC_CLOSE, CALL_CLOSE, "\n" + PARAM_OPEN)]
            ends = [(i, m) for i, m in ends if i >= 0]
            if not ends:
                return False
            index, marker = min(ends)
            events += self._argument(head[len(PARAM_OPEN):name_end].strip(), rest[:index])
            self._buf = rest[index + len(PARAM_CLOSE):] if marker == PARAM_CLOSE else rest[index:]
            return True
        if head.startswith(PARAM_CLOSE):      # a duplicated </parameter> (seen in the wild)
            self._buf = head[len(PARAM_CLOSE):]
            return True
        if head.startswith(FUNC_CLOSE):
            self._buf = head[len(FUNC_CLOSE):]
            events += self._close_args()
            self._phase = "after"
            return True
        if head.startswith(CALL_CLOSE):
            self._buf = head[len(CALL_CLOSE):]
            events += self._close_args()
            self._leave_call()
            return True
        if self._phase == "after" and head.startswith(FUNC_OPEN):
            self._phase = "header"            # several functions inside one <tool_call> block
            return True
        expected = (PARAM_OPEN, PARAM_CLOSE, FUNC_CLOSE, CALL_CLOSE, FUNC_OPEN)
        if not head or any(m.startswith(head) for m in expected):
            return False
        junk_end = head.find("<", 1)          # stray text between tags carries nothing: skip to the next tag
        self._buf = head[junk_end:] if junk_end > 0 else ""
        return junk_end > 0

    # -- helpers --------------------------------------------------------------------------------------------
    def _open_call(self, name: str) -> list[Any]:
        tool = (self._tools or {}).get(name) or {}
        self._call = {"index": self.tool_calls, "params": tool.get("parameters"), "args_open": False,
                      "args_closed": False}
        self.tool_calls += 1
        self._phase = "params"
        return [ToolCallStart(self._call["index"], new_call_id(), name)]

    def _argument(self, key: str, raw: str) -> list[Any]:
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = convert_parameter(raw, parameter_schema(self._call["params"], key))
        prefix = ", " if self._call["args_open"] else "{"
        self._call["args_open"] = True
        fragment = prefix + json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        return [ToolCallArgs(self._call["index"], fragment)]

    def _close_args(self) -> list[Any]:
        if self._call.get("args_closed", True):
            return []
        self._call["args_closed"] = True
        return [ToolCallArgs(self._call["index"], "}" if self._call["args_open"] else "{}")]

    def _json_call(self, body: str) -> list[Any]:
        """The JSON call format of earlier Qwen models: {"name": ..., "arguments": {...}}."""
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return []
        if not isinstance(args, dict):
            return []
        events = self._open_call(obj["name"])
        self._call["args_closed"] = True
        return events + [ToolCallArgs(self._call["index"], json.dumps(args, ensure_ascii=False))]

    def _raw_call_text(self, body: str) -> str:
        return CALL_OPEN + body

    def _leave_call(self) -> None:
        self.state, self._phase = CONTENT, ""
        self._content.boundary()
