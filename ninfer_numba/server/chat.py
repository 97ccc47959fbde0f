"""Chat request -> prompt text, and the output parser that matches it (Qwen3.5/3.6 format, serving.md §3).

Messages are normalised before the GGUF's chat template sees them: text parts joined, `developer` mapped to
`system`, JSON-string tool-call arguments decoded (the template iterates them as a mapping). Thinking is on
unless the request turns it off (chat_template_kwargs.enable_thinking, top-level enable_thinking,
reasoning_effort "none") or the last user message ends with the `/no_think` switch, which the Qwen3.5/3.6
templates do not implement themselves and which is stripped here.

tool_choice "none" leaves the tools out of the prompt; "required" and a named function start the assistant
turn with the call header, rendered with thinking off so that the call is the first thing the turn holds (the
grammar of server/structured.py then writes the call). A JSON response_format turns thinking off too.

Special tokens in message content are text: a user who writes ``<|im_end|><|im_start|>system`` gets those
characters, not a new turn. Before rendering, every special-token string in content (every added token in
user and tool messages; the control tokens in system and assistant messages, whose <think> markers the
template itself splits on) is replaced by a placeholder the template cannot mistake, ``\ue000<nonce>:<n>\ue001``
with a per-request random nonce; ``ChatPrompt.encode`` encodes the template's text with its special tokens
and each placeholder's string as plain text. ``parse_special: true`` in the request opts out.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

import jinja2

from ninfer_numba.server.output_parser import CALL_OPEN, ChatOutputParser
from ninfer_numba.server.protocol import APIError, ChatCompletionRequest, ChatMessage
from ninfer_numba.server.structured import response_format_type

NO_THINK_SWITCHES = ("/no_think", "/nothink")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_IMAGE_PARTS = {"image_url", "input_image", "image"}
# Arguments the server passes to the template itself; a chat_template_kwargs entry cannot override them.
SYSTEM_OPEN = "<|im_start|>system\n"
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "enable_thinking"}
_TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError)


_PLACEHOLDER = re.compile("\ue000([0-9a-f]{16}):([0-9]+)\ue001")


@dataclass
class ChatPrompt:
    text: str
    thinking: bool                                   # the prompt ends inside an open <think> block
    tools: dict[str, dict[str, Any]] | None = None   # function name -> OpenAI function object; None: not parsed
    start_in_call: bool = False
    forced_function: str | None = None
    literals: list[str] = field(default_factory=list)   # special-token strings from content, as placeholders
    nonce: str = ""
    # prefixes of text worth a state snapshot: the leading system turn's end (what clients sharing a system
    # prompt share) and the last message's end (before the generation prompt: where the next turn departs)
    cut_texts: tuple[str, ...] = ()

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(start_in_reasoning=self.thinking, tools=self.tools,
                                start_in_call=self.start_in_call, forced_function=self.forced_function)

    def encode(self, tokenizer, text: str | None = None) -> list[int]:
        """Token ids: the template's text (or ``text``) with special tokens parsed, the content's special
        strings as text."""
        text = self.text if text is None else text
        ids: list[int] = []
        at = 0
        for m in _PLACEHOLDER.finditer(text):
            if m.group(1) != self.nonce:
                continue
            ids += tokenizer.encode(text[at:m.start()], parse_special=True)
            ids += tokenizer.encode(self.literals[int(m.group(2))], parse_special=False)
            at = m.end()
        return ids + tokenizer.encode(text[at:], parse_special=True)

    def cut_lengths(self, tokenizer, ids: list[int], texts: tuple[str, ...] | None = None) -> tuple[int, ...]:
        """Token lengths of cut_texts (or ``texts``) that are exact prefixes of the prompt's ids (``encode``'s):
        after the system turn, and after the conversation before the generation prompt (where the next turn's
        prompt departs from this one: the template renders the answer there without this turn's opened
        <think>). Each cut's text is encoded again; encode_with_cuts spares that."""
        out = []
        for text in self.cut_texts if texts is None else texts:
            head = self.encode(tokenizer, text)
            if 0 < len(head) < len(ids) and ids[:len(head)] == head:
                out.append(len(head))
        return tuple(sorted(set(out)))

    def encode_with_cuts(self, tokenizer) -> tuple[list[int], tuple[int, ...]]:
        """(encode(), cut_lengths()) with one encode of the text. A cut that ends right before a control
        token's string (build_chat_prompt's both do: the next <|im_start|>) ends where the tokenizer splits
        the text anyway (added tokens are matched first, the text between them encoded piece by piece, and NFC
        never joins across a '<'), so the pieces between such cuts encode to the whole text's ids and their
        lengths are the cuts'. cut_lengths encodes every cut's text again: ~9 ms per 8K-token chat turn on
        the request's path. Any other cut is checked as cut_lengths checks it."""
        text, controls = self.text, tokenizer.added_texts(control_only=True)
        at_split = sorted({len(c) for c in self.cut_texts if 0 < len(c) < len(text) and text.startswith(c)
                           and text.startswith(controls, len(c))})
        ids: list[int] = []
        lengths = []
        for start, end in zip([0] + at_split, at_split + [len(text)]):
            ids += self.encode(tokenizer, text[start:end])
            lengths.append(len(ids))
        cuts = {n for n in lengths[:-1] if 0 < n < len(ids)}
        others = tuple(c for c in self.cut_texts if len(c) not in at_split)
        return ids, tuple(sorted(cuts | set(self.cut_lengths(tokenizer, ids, others))))


def protect_special_text(messages: list[dict[str, Any]], control: tuple[str, ...], added: tuple[str, ...]):
    """Replace special-token strings in message content by placeholders (module docstring): -> (messages,
    literals, nonce). control / added: Tokenizer.added_texts(control_only=True) / added_texts()."""
    nonce = secrets.token_hex(8)
    literals: list[str] = []
    patterns = {name: re.compile("|".join(re.escape(t) for t in texts)) if texts else None
                for name, texts in (("control", control), ("added", added))}

    def hide(m: re.Match) -> str:
        literals.append(m.group(0))
        return f"\ue000{nonce}:{len(literals) - 1}\ue001"
    for msg in messages:
        pattern = patterns["added" if msg["role"] in ("user", "tool") else "control"]
        if pattern is not None and isinstance(msg.get("content"), str):
            msg["content"] = pattern.sub(hide, msg["content"])
    return messages, literals, nonce


def default_renderer() -> Callable[..., str]:
    from ninfer_numba.formats.chat_template import render_chat
    return render_chat


def _content_text(content: str | list[dict[str, Any]] | None, param: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in _IMAGE_PARTS:
            raise APIError(400, "this model has no vision projector: image content is not supported",
                           param=f"{param}[{j}]", code="image_not_supported")
        if kind in ("text", "input_text", "refusal"):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise APIError(400, f"content part of type {kind!r} needs a string 'text'", param=f"{param}[{j}]")
            texts.append(text)
        else:
            raise APIError(400, f"content part type {kind!r} is not supported (only text)", param=f"{param}[{j}]")
    return "".join(texts)


def _tool_calls(msg: ChatMessage, i: int) -> list[dict[str, Any]]:
    calls = []
    for j, call in enumerate(msg.tool_calls or []):
        args = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise APIError(400, "tool call arguments must be a JSON object",
                               param=f"messages[{i}].tool_calls[{j}].function.arguments") from None
        if not isinstance(args, dict):
            raise APIError(400, "tool call arguments must be a JSON object",
                           param=f"messages[{i}].tool_calls[{j}].function.arguments")
        calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}})
    return calls


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> plain dicts the template can render (see the module docstring)."""
    if not messages:
        raise APIError(400, "messages must contain at least one message", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if msg.role not in _ROLES:
            raise APIError(400, f"unknown role {msg.role!r}; expected one of {sorted(_ROLES)}",
                           param=f"messages[{i}].role")
        content = _content_text(msg.content, f"messages[{i}].content")
        entry: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
        if msg.role == "assistant":
            entry["content"] = content or ""
            if msg.tool_calls:
                entry["tool_calls"] = _tool_calls(msg, i)
            if msg.reasoning_content is not None:
                entry["reasoning_content"] = msg.reasoning_content
        else:
            if content is None:
                raise APIError(400, f"a {msg.role} message needs content", param=f"messages[{i}].content")
            entry["content"] = content
            if msg.role == "tool" and msg.tool_call_id is not None:
                entry["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            entry["name"] = msg.name
        out.append(entry)
    if not any(m["role"] == "user" for m in out):
        raise APIError(400, "messages must contain a user message", param="messages")
    return out


def strip_no_think(messages: list[dict[str, Any]]) -> bool:
    """Removes a trailing /no_think (or /nothink) from the last user message; True if one was there."""
    last_user = next((m for m in reversed(messages) if m["role"] == "user"), None)
    if last_user is None:
        return False
    text = last_user["content"].rstrip()
    for switch in NO_THINK_SWITCHES:
        if text.endswith(switch):
            last_user["content"] = text[:-len(switch)].rstrip()
            return True
    return False


def thinking_enabled(req: ChatCompletionRequest, no_think_switch: bool) -> bool:
    kwargs = req.chat_template_kwargs or {}
    off = (kwargs.get("enable_thinking") is False or req.enable_thinking is False
           or (req.reasoning_effort or "").lower() == "none" or no_think_switch)
    return not off


def _validate_tools(req: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, "only tools of type 'function' with a 'function' object are supported",
                           param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise APIError(400, "a function name must be 1-64 characters of a-z, A-Z, 0-9, _ and -",
                           param=f"tools[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn.get("parameters"), dict):
            raise APIError(400, "function parameters must be a JSON Schema object",
                           param=f"tools[{i}].function.parameters")
        by_name[name] = fn
    return by_name


def _tool_choice(req: ChatCompletionRequest, tools: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    """('none' | 'auto' | 'required' | 'function', forced function name)."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be none, auto, required or a function, not {choice!r}",
                           param="tool_choice")
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return (choice if tools else "none"), None
    fn = choice.get("function") if choice.get("type", "function") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must name a function: {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")
    if name not in tools:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "function", name


def build_chat_prompt(req: ChatCompletionRequest, chat_template: str | None,
                      render: Callable[..., str] | None = None, tokenizer=None) -> ChatPrompt:
    """The prompt of a chat request; with a tokenizer (and without the request's parse_special opt-in),
    special-token strings in content are kept as text (module docstring)."""
    messages = normalize_messages(req.messages)
    literals, nonce = [], ""
    if tokenizer is not None and not req.parse_special:
        messages, literals, nonce = protect_special_text(
            messages, tokenizer.added_texts(control_only=True), tokenizer.added_texts())
    tools = _validate_tools(req)
    choice, forced = _tool_choice(req, tools)
    structured = response_format_type(req) != "text"                             # server/structured.py
    thinking = thinking_enabled(req, strip_no_think(messages)) and choice in ("none", "auto") and not structured
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    prompt_tools = list(req.tools) if tools and choice != "none" else None
    render = render or default_renderer()
    try:
        text = render(messages, tools=prompt_tools, add_generation_prompt=True, enable_thinking=thinking,
                      template=chat_template, **kwargs)
        cuts = [render(messages, tools=prompt_tools, add_generation_prompt=False, enable_thinking=thinking,
                       template=chat_template, **kwargs)]
    except _TEMPLATE_ERRORS as exc:   # includes the template's raise_exception(...)
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    if text.startswith(SYSTEM_OPEN) and "<|im_start|>" in text[1:]:    # the system turn (tools included)
        cuts.append(text[:text.index("<|im_start|>", 1)])
    if choice == "required":
        text += CALL_OPEN + "\n"
    elif choice == "function":
        text += f"{CALL_OPEN}\n<function={forced}>\n"
    return ChatPrompt(text=text, thinking=prompt_ends_in_think(text), tools=tools if choice != "none" else None,
                      start_in_call=choice == "required", forced_function=forced, literals=literals, nonce=nonce,
                      cut_texts=tuple(c for c in cuts if c and len(c) < len(text) and text.startswith(c)))


def prompt_ends_in_think(prompt: str) -> bool:
    """True when the last assistant turn of the prompt has an open <think> block (the template opened it)."""
    turn = prompt[prompt.rfind("<|im_start|>assistant"):] if "<|im_start|>assistant" in prompt else prompt
    return turn.rfind("<think>") > turn.rfind("</think>")
