"""The grammar a chat request puts on its output: tool calls that must happen, JSON that must parse.

- ``tool_choice`` "required" or a named function: the prompt already opened the call (chat.py); the grammar
  makes the rest a well-formed Qwen3.5 call of one of the tools (of the named one) whose parameters are
  valid against the function's schema, then the end of the turn.
- ``response_format`` ``json_object``: the answer is one JSON object; ``json_schema``: one JSON value valid
  against ``json_schema.schema`` (OpenAI's ``strict`` is implied: the grammar cannot write anything else).
  Thinking is turned off for these requests (chat.py), so the JSON is the whole answer.
A forced tool call takes precedence over a response format. The grammars come from engine/constraint.py
(llguidance); a schema it cannot compile is the client's error (400).
"""
from __future__ import annotations

from typing import Any

from ninfer_numba.engine.constraint import TokenConstraint, json_constraint, tool_call_constraint
from ninfer_numba.server.protocol import APIError, ChatCompletionRequest

JSON_FORMATS = ("json_object", "json_schema")


def response_format_type(req: ChatCompletionRequest) -> str:
    fmt = req.response_format or {}
    kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
    if kind not in ("text",) + JSON_FORMATS:
        raise APIError(400, f"response_format type must be text, json_object or json_schema, not {kind!r}",
                       param="response_format")
    return kind


def _json_schema(req: ChatCompletionRequest) -> dict[str, Any]:
    spec = req.response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON Schema object",
                       param="response_format.json_schema.schema")
    return schema


def request_constraint(req: ChatCompletionRequest, prompt, tokenizer, stop_ids) -> TokenConstraint | None:
    """The grammar of a chat request's output, or None. ``prompt`` is chat.build_chat_prompt's result."""
    forced_call = prompt.tools is not None and (prompt.start_in_call or prompt.forced_function is not None)
    kind = response_format_type(req)
    if not forced_call and kind == "text":
        return None
    if not stop_ids:
        raise APIError(400, "ignore_eos cannot be combined with a forced tool call or a JSON response format: "
                            "the grammar ends the answer with the end-of-turn token", param="ignore_eos")
    try:
        if forced_call:
            return tool_call_constraint(tokenizer, prompt.tools, prompt.forced_function, stop_ids)
        return json_constraint(tokenizer, _json_schema(req) if kind == "json_schema" else None, stop_ids)
    except ValueError as exc:
        param = "tools" if forced_call else "response_format"
        raise APIError(400, f"cannot constrain the output: {exc}", param=param) from None
