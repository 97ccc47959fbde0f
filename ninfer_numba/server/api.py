"""The FastAPI app: OpenAI endpoints, llama-server style /health, /tokenize and /detokenize, API-key check.

Every error leaves in OpenAI's shape {"error": {"message", "type", "param", "code"}}: malformed requests as 400,
a bad key as 401, unknown models and paths as 404, a body over the size limit as 413 (refused from its
Content-Length before it is read, or as soon as a chunked body passes the limit), a full queue as 429 with
Retry-After (the OpenAI SDK waits that long and retries). Server-side failures are
500 with `x-should-retry: false`, because the OpenAI SDK would otherwise resend the same request twice.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ninfer_numba.server import completions
from ninfer_numba.server.chat import build_chat_prompt
from ninfer_numba.server.engine_api import ServedEngine, check_engine
from ninfer_numba.server.protocol import (APIError, ChatCompletionRequest, DetokenizeRequest, TokenizeRequest,
                                          parse_request)
from ninfer_numba.server.responses import ResponseHeader
from ninfer_numba.server.worker import GenerationWorker

log = logging.getLogger("ninfer_numba.server")
OPEN_PATHS = frozenset({"/health", "/v1/health"})   # answered without an API key, for load balancers
MIN_BODY_LIMIT = 2 << 20                               # bytes; raised to 32 bytes per token of context
MAX_QUEUE = 64                                         # requests waiting behind the running ones, then 429
BATCH_SLOTS = 4                                        # greedy requests decoded together (server/batching.py)
DEFAULT_MAX_TOKENS = 16384                             # completion tokens when a request sets no limit
RETRY_AFTER_S = 2                                      # the 429's Retry-After


def body_limit(max_seq: int) -> int:
    """The largest request body accepted: room for a prompt filling the context (a token is ~4 bytes of text,
    JSON escaping can multiply that), and never less than 2 MiB."""
    return max(MIN_BODY_LIMIT, 32 * max_seq)


class ServerState:
    """What the handlers share: the engine, its worker, the served model id and the admission limits."""

    def __init__(self, llm: ServedEngine, model_id: str, *, max_queue: int = MAX_QUEUE,
                 default_max_tokens: int | None = DEFAULT_MAX_TOKENS, batch_slots: int = BATCH_SLOTS):
        if max_queue < 0 or (default_max_tokens is not None and default_max_tokens < 1):
            raise ValueError(f"max_queue must be >= 0 and default_max_tokens >= 1 (got {max_queue}, "
                             f"{default_max_tokens})")
        self.llm = llm
        self.model_id = model_id
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        stem = str(llm.model_id)
        names = {model_id, stem, stem + ".gguf"}
        path = getattr(llm, "path", None)
        if path:
            names |= {str(path), Path(path).name}
        self.accepted_ids = frozenset(names)
        self.created = int(time.time())
        self.fingerprint = f"ninfer_numba-{getattr(llm, 'backend', 'engine')}"
        self.worker = GenerationWorker(llm, batch_slots)

    async def read_json(self, request: Request) -> Any:
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise APIError(400, "the client disconnected before the request body arrived") from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None

    def submit(self, job) -> None:
        """Queue a job, or 429 when max_queue requests already wait (checked and queued with no await between,
        so concurrent handlers on the event loop cannot overshoot)."""
        waiting = self.worker.queued
        if waiting >= self.max_queue:
            raise APIError(429, f"the server is busy: {waiting} requests are waiting; retry in {RETRY_AFTER_S} s",
                           type="server_busy", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.worker.submit(job)

    def check_model(self, model: str | None) -> None:
        if model and model not in self.accepted_ids:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    def require_tokenizer(self):
        if self.llm.tokenizer is None:
            raise APIError(400, "this model file has no vocabulary, so text cannot be encoded or decoded")
        return self.llm.tokenizer

    def header(self, kind: str, req) -> ResponseHeader:
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        return ResponseHeader(kind, self.model_id, self.fingerprint, include_usage)

    def model_card(self) -> dict[str, Any]:
        cfg = self.llm.config
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "ninfer_numba",
                "max_model_len": self.llm.max_seq,
                "meta": {"n_vocab": cfg.n_vocab, "n_ctx": self.llm.max_seq, "n_ctx_train": cfg.context_length,
                         "n_embd": cfg.n_embd, "n_layer": cfg.n_layer}}


class APIKeyMiddleware:
    """Bearer-token check as plain ASGI middleware (it must not buffer or wrap streamed responses)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                err = APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``: at once from its Content-Length, or while a chunked body
    streams in (plain ASGI: it must not buffer anything itself)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _error_response(self._too_large())(scope, receive, send)
            return
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self._too_large()
            return message
        await self.app(scope, counted, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")


def _error_response(err: APIError) -> JSONResponse:
    headers = {"x-should-retry": "false"} if err.status >= 500 else {}
    return JSONResponse(err.body(), status_code=err.status, headers={**headers, **(err.headers or {})})


def create_app(llm: ServedEngine, *, api_key: str | None = None, model_id: str | None = None,
               max_queue: int = MAX_QUEUE, default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
               batch_slots: int = BATCH_SLOTS) -> FastAPI:
    """The OpenAI-compatible app for one loaded engine (server/engine_api.py: engine/llm.LLM or any object with
    those members, checked here); `model_id` defaults to llm.model_id (the GGUF stem).
    max_queue: requests allowed to wait (more get 429); default_max_tokens: the completion limit of a request
    that sets none (None: the rest of the context); batch_slots: greedy requests decoded together (1: every
    request alone, one after another; server/worker.py)."""
    check_engine(llm, batch_slots)
    server = ServerState(llm, model_id or str(llm.model_id), max_queue=max_queue,
                         default_max_tokens=default_max_tokens, batch_slots=batch_slots)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.worker.stop()

    app = FastAPI(title="ninfer_numba", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    app.add_middleware(BodyLimitMiddleware, max_bytes=body_limit(llm.max_seq))
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)    # outermost: a bad key is refused first

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error_response(APIError(exc.status_code, message, code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error_response(APIError(400, f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        server.check_model(model)
        return server.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completions.chat_completions(request, server)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        return await completions.completions(request, server)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_request(TokenizeRequest, await server.read_json(request))
        tokenizer = server.require_tokenizer()
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages)
            text = build_chat_prompt(chat, llm.chat_template).text
        elif req.content is not None or req.prompt is not None:
            text = req.content if req.content is not None else req.prompt
        else:
            raise APIError(400, "give 'content' (or 'prompt') text, or 'messages'", param="content")
        ids = tokenizer.encode(text, parse_special=req.parse_special)
        tokens: list[Any] = ids
        if req.with_pieces:
            tokens = [{"id": i, "piece": tokenizer.decode([i])} for i in ids]
        return {"tokens": tokens, "count": len(ids), "max_model_len": llm.max_seq}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await server.read_json(request))
        tokenizer = server.require_tokenizer()
        bad = [t for t in req.tokens if not 0 <= t < tokenizer.n_vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {tokenizer.n_vocab}): {bad[:5]}", param="tokens")
        return {"content": tokenizer.decode(req.tokens)}

    return app


def warm_up(llm) -> None:
    """What the first requests would otherwise build while holding the GIL (the event loop then answers
    nothing, /health included, for that long): the chat template compiled and rendered once, the rendered
    text tokenized, and the llguidance tokenizer when constrained decoding is installed (about 2 s at 248K
    tokens). A template that fails here fails per request later, with its message."""
    from ninfer_numba.formats.chat_template import render_chat
    tokenizer = getattr(llm, "tokenizer", None)
    try:
        text = render_chat([{"role": "user", "content": "Hi"}], template=getattr(llm, "chat_template", None))
        if tokenizer is not None:
            tokenizer.encode(text)
    except Exception as exc:  # noqa: BLE001  (reported per request, where the client sees it)
        log.warning("chat template warm-up failed: %s", exc)
    try:
        from ninfer_numba.engine.constraint import lltokenizer
    except ImportError:                     # llguidance not installed: grammars are refused per request
        return
    if tokenizer is not None and tokenizer.eos_ids:
        lltokenizer(tokenizer)


def serve(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
          model_id: str | None = None, log_level: str = "info", **limits) -> None:
    """Serves `llm` until interrupted; limits: create_app's max_queue, default_max_tokens and batch_slots. The
    first requests' one-time work is done before listening (warm_up), so they are answered as fast as the rest
    and /health meanwhile."""
    import uvicorn
    warm_up(llm)
    uvicorn.run(create_app(llm, api_key=api_key, model_id=model_id, **limits), host=host, port=port,
                log_level=log_level)
