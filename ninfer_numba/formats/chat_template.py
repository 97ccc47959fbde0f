"""Qwen3.5/3.6 chat format: our default jinja2 template and the renderer used for it and for GGUF templates.

The renderer mirrors the environment HF-style templates are written for (ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, ``tojson`` as json.dumps(ensure_ascii=False), a ``raise_exception`` global), so
the template shipped in a GGUF renders as it does elsewhere. Messages are normalised in Python first: clients
send shapes the Qwen templates reject (role "developer", tool-call arguments as JSON strings, content parts).
Format rules: reference/serving.md §3.2-3.3.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TOOL_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)

# Every tag strips the whitespace around it ({%- -%}, {{- -}}), so the layout below never reaches the output.
# The tool instructions are the official template's text byte for byte (spliced in as one string literal).
# Non-string tool-call arguments render as JSON (true, null), as the Qwen3.6 template does; Qwen3.5's renders
# scalars with str() (True, None). preserve_thinking is Qwen3.6's switch to keep reasoning in all turns.
DEFAULT_CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is sequence and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported.') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is defined and content is not none -%}
        {{- raise_exception('Message content must be a string, null or a list of text parts.') -}}
    {%- endif -%}
{%- endmacro -%}

{%- if not messages -%}
    {{- raise_exception('No messages provided.') -}}
{%- endif -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>' ~ TOOL_INSTRUCTIONS -}}
    {%- if has_system -%}
        {%- set system_text = text_of(messages[0].content) | trim -%}
        {%- if system_text -%}
            {{- '\n\n' ~ system_text -}}
        {%- endif -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' ~ (text_of(messages[0].content) | trim) ~ '<|im_end|>\n' -}}
{%- endif -%}

{#- The last user turn that is a real query, not tool output wrapped by an older client. Reasoning is kept only
    for assistant turns after it, i.e. inside the current tool loop, unless preserve_thinking (Qwen3.6) is true. -#}
{%- set state = namespace(last_query=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set text = text_of(message.content) | trim -%}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
            {%- set state.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if state.last_query < 0 -%}
    {{- raise_exception('No user query found in messages.') -}}
{%- endif -%}

{%- for message in messages -%}
    {%- set text = text_of(message.content) | trim -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('The system message must be the first message.') -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ text ~ '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in text -%}
            {%- set reasoning = text.split('</think>')[0].split('<think>')[-1] -%}
            {%- set text = text.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > state.last_query -%}
            {{- '<think>\n' ~ (reasoning | trim) ~ '\n</think>\n\n' -}}
        {%- endif -%}
        {{- text -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if not loop.first -%}
                {{- '\n' -}}
            {%- elif text | trim -%}
                {{- '\n\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n<function=' ~ fn.name ~ '>\n' -}}
            {%- if fn.arguments is string -%}
                {{- raise_exception('Tool-call arguments must be an object, not a JSON string.') -}}
            {%- endif -%}
            {%- for key, value in (fn.arguments or {}) | items -%}
                {{- '<parameter=' ~ key ~ '>\n' -}}
                {%- if value is string -%}
                    {{- value -}}
                {%- else -%}
                    {{- value | tojson -}}
                {%- endif -%}
                {{- '\n</parameter>\n' -}}
            {%- endfor -%}
            {{- '</function>\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {#- Consecutive tool results share one user turn; they are matched to calls by position. -#}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' ~ text ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unexpected message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
""".replace("TOOL_INSTRUCTIONS", json.dumps(_TOOL_INSTRUCTIONS))

_ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}


class ChatTemplateError(ValueError):
    """A template called raise_exception, or failed on the messages it was given."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and '; templates expect plain JSON with non-ASCII kept.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}.content[{j}]: only {{'type': 'text', 'text': str}} parts are "
                                 f"supported, got {kind!r}")
            pieces.append(part["text"])
        return "".join(pieces)
    raise ValueError(f"{where}.content must be a string, null or a list of text parts, "
                     f"got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where} must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {exc}") from exc
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}.function.arguments must be a JSON object, got {type(args).__name__}")
    out = {k: v for k, v in call.items() if k != "function"}
    out.setdefault("type", "function")
    out["function"] = {**fn, "arguments": dict(args)}
    return out


def normalize_messages(messages: Any) -> list[dict]:
    """Copies of ``messages`` the template can render: known roles, string content, dict tool arguments."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where} must be an object with a 'role'")
        role = _ROLE_ALIASES.get(msg.get("role"), msg.get("role"))
        if role not in _ROLES:
            raise ValueError(f"{where}: unknown role {msg.get('role')!r}; expected one of "
                             f"system, developer, user, assistant, tool")
        norm = dict(msg, role=role, content=_content_text(msg.get("content"), where))
        calls = msg.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, (list, tuple)):
                raise ValueError(f"{where}.tool_calls must be a list on an assistant message")
            norm["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(norm)
    if not any(m["role"] == "user" for m in out):
        raise ValueError("messages contain no user message")
    return out


def render_chat(messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                enable_thinking: bool = True, template: str | None = None, **template_kwargs) -> str:
    """The prompt text for ``messages`` (OpenAI chat shapes), rendered with ``template`` or our default."""
    norm = normalize_messages(messages)
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, Mapping) for t in tools)):
        raise ValueError("tools must be a list of objects")
    compiled = _compile(template if template is not None else DEFAULT_CHAT_TEMPLATE)
    try:
        return compiled.render(messages=norm, tools=list(tools) if tools else None,
                               add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                               **template_kwargs)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError) as exc:
        raise ValueError(f"chat template failed on these messages: {exc}") from exc
