"""POST /v1/chat/completions and POST /v1/completions: validate, build the prompt, queue, answer.

Everything that can be wrong with a request is found before the job is queued and answered with a 400/404;
once queued, an engine failure becomes an SSE error event (streaming) or a 500 that the OpenAI SDK is told
not to retry (non-streaming). A client that goes away cancels its job.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ninfer_numba.server.chat import build_chat_prompt
from ninfer_numba.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, parse_request,
                                          reject_unsupported, resolve_max_tokens, sampling_params, stop_strings)
from ninfer_numba.server.responses import (ChatAccumulator, ResponseHeader, chat_deltas, completion_logprobs,
                                           logprob_entries, sse, text_delta, usage)
from ninfer_numba.server.structured import request_constraint
from ninfer_numba.server.worker import Failed, Finished, Job, PlainTextParser

DISCONNECT_POLL_S = 0.25   # how often a waiting non-streaming handler checks that its client is still there
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _max_tokens(req, n_prompt: int, server) -> int:
    requested, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    return resolve_max_tokens(requested, n_prompt, server.llm.max_seq, param, server.default_max_tokens)


def _completion_prompt_ids(req: CompletionRequest, tokenizer, n_vocab: int) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, parse_special=True)
    bad = [t for t in prompt if not 0 <= t < n_vocab]
    if bad:
        raise APIError(400, f"token ids out of range [0, {n_vocab}): {bad[:5]}", param="prompt")
    return list(prompt)


async def chat_completions(request: Request, server) -> Any:
    received = time.perf_counter()
    with server.worker.arriving():                                           # read, prepared and queued
        req = parse_request(ChatCompletionRequest, await server.read_json(request))
        server.check_model(req.model)
        reject_unsupported(req)
        tokenizer = server.require_tokenizer()
        prompt = build_chat_prompt(req, server.llm.chat_template, tokenizer=tokenizer)
        ids, cuts = await asyncio.to_thread(prompt.encode_with_cuts, tokenizer)  # long prompts: off the event loop
        params = sampling_params(req, _max_tokens(req, len(ids), server), server.llm.config.n_vocab)
        constraint = await asyncio.to_thread(request_constraint, req, prompt, tokenizer,
                                             params.stop_ids(tokenizer.eos_ids))
        job = Job(ids, params, stop_strings(req), prompt.parser(), asyncio.get_running_loop(), constraint,
                  snapshot_at=cuts, received=received)
        header = server.header("chat", req)
        server.submit(job)
    if req.stream:
        return StreamingResponse(_stream_chat(job, header), media_type="text/event-stream", headers=_SSE_HEADERS)
    acc = ChatAccumulator()
    done = await _collect(job, request, acc.add)
    message = acc.message()
    logprobs = {"content": acc.logprobs} if params.logprobs is not None else None
    return JSONResponse(header.body({"index": 0, "message": message, "logprobs": logprobs,
                                     "finish_reason": done.reason}, done))


async def completions(request: Request, server) -> Any:
    received = time.perf_counter()
    with server.worker.arriving():                                           # read, prepared and queued
        req = parse_request(CompletionRequest, await server.read_json(request))
        server.check_model(req.model)
        reject_unsupported(req)
        tokenizer = server.require_tokenizer()
        ids = _completion_prompt_ids(req, tokenizer, server.llm.config.n_vocab)
        params = sampling_params(req, _max_tokens(req, len(ids), server), server.llm.config.n_vocab)
        job = Job(ids, params, stop_strings(req), PlainTextParser(), asyncio.get_running_loop(), received=received)
        header = server.header("text", req)
        echo = tokenizer.decode(ids) if req.echo else ""
        server.submit(job)
    if req.stream:
        return StreamingResponse(_stream_text(job, header, echo), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)
    pieces, entries = [echo], []

    def sink(events):
        pieces.append(text_delta(events))
        entries.extend(logprob_entries(events))
    done = await _collect(job, request, sink)
    logprobs = completion_logprobs(entries) if params.logprobs is not None else None
    return JSONResponse(header.body({"index": 0, "text": "".join(pieces), "logprobs": logprobs,
                                     "finish_reason": done.reason}, done))


async def _collect(job: Job, request: Request, sink) -> Finished:
    """Waits for a non-streaming job, feeding event batches to `sink`; cancels it if the client leaves."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.events.get(), max(next_check - loop.time(), 0.0))
            except asyncio.TimeoutError:
                item = None
            if loop.time() >= next_check:   # checked on a clock: a busy job never leaves the queue empty
                if await request.is_disconnected():
                    job.cancel()
                    raise APIError(400, "the client disconnected", code="client_disconnected")
                next_check = loop.time() + DISCONNECT_POLL_S
            if item is None:
                continue
            if isinstance(item, Finished):
                return item
            if isinstance(item, Failed):
                raise APIError(500, item.message, type="server_error")
            sink(item)
    except asyncio.CancelledError:
        job.cancel()
        raise


def _error_event(message: str) -> str:
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})


def _chat_choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _text_choice(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _stream_chat(job: Job, header: ResponseHeader) -> AsyncIterator[str]:
    def choices(item):
        out = [_chat_choice(d) for d in chat_deltas(item)]
        entries = logprob_entries(item)
        if entries:                    # on the batch's first chunk (an empty delta when the text is held back)
            out = out or [_chat_choice({})]
            out[0]["logprobs"] = {"content": entries}
        return out
    return _stream(job, header, [_chat_choice({"role": "assistant", "content": None})], _chat_choice({}),
                   choices)


def _stream_text(job: Job, header: ResponseHeader, echo: str) -> AsyncIterator[str]:
    offset = [0]                      # characters of completion text streamed so far (for text_offset)

    def choices(item):
        text, entries = text_delta(item), logprob_entries(item)
        if not text and not entries:
            return []
        choice = _text_choice(text)
        if entries:
            choice["logprobs"] = completion_logprobs(entries, offset[0])
        offset[0] += sum(len(e["token"]) for e in entries)
        return [choice]
    return _stream(job, header, [_text_choice(echo)] if echo else [], _text_choice(""), choices)


async def _stream(job: Job, header: ResponseHeader, opening: list[dict[str, Any]], last: dict[str, Any],
                  choices) -> AsyncIterator[str]:
    """SSE of one job: the opening chunks, one chunk per choice of each engine event (``choices(item)``),
    the finishing chunk (``last`` with the finish reason), the usage chunk when asked, then [DONE]."""
    try:
        for c in opening:
            yield sse(header.chunk([c]))
        while True:
            item = await job.events.get()
            if isinstance(item, Finished):
                yield sse(header.chunk([{**last, "finish_reason": item.reason}]))
                if header.include_usage:
                    yield sse(header.chunk([], usage(item), item.timings))
                break
            if isinstance(item, Failed):
                yield _error_event(item.message)
                break
            for c in choices(item):
                yield sse(header.chunk([c]))
        yield sse("[DONE]")
    finally:
        job.cancel()   # no-op once finished; stops the generation when the client went away
