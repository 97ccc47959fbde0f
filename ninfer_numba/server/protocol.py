"""OpenAI request models, the error type every handler raises, and request -> SamplingParams conversion.

Unknown fields are ignored (clients send cloud-only fields such as `user`, `store`, `metadata`); fields this engine
cannot honour (n > 1, logit_bias, prompt logprobs) are rejected with a 400 rather than ignored.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ninfer_numba.config import MAX_TOP_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 16
_UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers          # extra response headers (Retry-After on a 429)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class ToolCallFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _SamplingFields(_Lenient):
    """Fields shared by /v1/chat/completions and /v1/completions."""
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None              # vLLM's extra sampling parameters
    stop_token_ids: list[int] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    parse_special: bool = False     # extension: special-token strings in message content become the tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Lenient):
    content: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(_Lenient):
    tokens: list[int] = Field(default_factory=list)


def parse_request(model_cls: type[BaseModel], body: Any) -> Any:
    """Validates a decoded JSON body strictly (no "10" for 10, no "yes" for true); errors are 400s naming the
    first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    extra = body.get("extra_body")
    if isinstance(extra, dict):  # some clients send the SDK's extra_body literally
        body = {**extra, **{k: v for k, v in body.items() if k != "extra_body"}}
    try:
        return model_cls.model_validate(body, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _loc_to_param(first.get("loc", ()))
        raise APIError(400, f"invalid value for '{param}': {first.get('msg', 'invalid')}", param=param) from None


def _loc_to_param(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif part in _UNION_MEMBER_TAGS or "[" in str(part):
            continue  # pydantic names the union member that failed; that says nothing to a client
        else:
            out += f".{part}"
    return out or "body"


def reject_unsupported(req: _SamplingFields) -> None:
    """400 for fields that change semantics and that this engine cannot honour."""
    if req.n is not None and req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and req.echo:
            raise APIError(400, "logprobs of the prompt (echo with logprobs) are not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != 1:
            raise APIError(400, "only best_of=1 is supported", param="best_of")


def stop_strings(req: _SamplingFields) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop")
    return [s for s in stops if s]


def resolve_max_tokens(requested: int | None, n_prompt: int, max_seq: int, param: str,
                       default_cap: int | None = None) -> int:
    """Prompt + generated tokens must fit the context; without a limit the rest of the context is the limit,
    capped at ``default_cap`` (the server's configured default) when one is set."""
    if n_prompt < 1:
        raise APIError(400, "the prompt is empty", param="prompt")
    if n_prompt >= max_seq:
        raise APIError(400, f"the prompt has {n_prompt} tokens; the context holds {max_seq} "
                            "(prompt and completion together)", param="messages", code="context_length_exceeded")
    room = max_seq - n_prompt
    if requested is None:
        return room if default_cap is None else min(room, default_cap)
    if requested < 1:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
    if requested > room:
        raise APIError(400, f"{param}={requested} plus the prompt's {n_prompt} tokens exceeds the context of "
                            f"{max_seq} tokens; ask for at most {room}", param=param, code="context_length_exceeded")
    return requested


def requested_logprobs(req: _SamplingFields) -> int | None:
    """Alternatives per token the response lists (None: no logprobs): chat's logprobs + top_logprobs, the
    legacy completions' integer logprobs."""
    if isinstance(req, ChatCompletionRequest):
        n, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        n, param = getattr(req, "logprobs", None), "logprobs"
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {n}", param=param)
    return n


def sampling_params(req: _SamplingFields, max_tokens: int, n_vocab: int) -> SamplingParams:
    """OpenAI defaults (temperature 1, top_p 1) where the request is silent; ranges as in OpenAI's API.
    vLLM's ``ignore_eos`` and ``stop_token_ids`` (ids in [0, n_vocab)) are accepted too."""
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    fields = dict(max_tokens=max_tokens, temperature=temperature, seed=req.seed, ignore_eos=bool(req.ignore_eos),
                  logprobs=requested_logprobs(req))
    if req.stop_token_ids:
        bad = [i for i in req.stop_token_ids if not 0 <= i < n_vocab]
        if bad:
            raise APIError(400, f"stop_token_ids must be token ids in [0, {n_vocab}), got {bad[:4]}",
                           param="stop_token_ids")
        fields["stop_token_ids"] = tuple(req.stop_token_ids)
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if fields.get("top_k") == -1:   # vLLM's spelling of "off"
        fields["top_k"] = 0
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=param if param in fields else None) from None
