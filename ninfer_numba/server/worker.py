"""The single generation worker: requests are queued and run one at a time on one thread.

The engine serves one stream at a time, so HTTP handlers (on the event loop) never touch it: they submit a
Job and read its events from an asyncio queue. Per generated token the worker decodes text (holding back an
incomplete UTF-8 character), cuts at stop strings (holding back a partial one) and runs the output parser;
the events it posts are the same for streaming and non-streaming responses. A cancelled job (client gone)
is skipped if still queued, or stopped at its next token by closing the engine's generator, which frees
the engine for the next job.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from ninfer_numba.config import SamplingParams
from ninfer_numba.formats.tokenizer import IncrementalDecoder
from ninfer_numba.server.output_parser import CONTENT, REASONING, TextDelta
from ninfer_numba.server.stop_strings import StopStringFilter

log = logging.getLogger("ninfer_numba.server")


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str               # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int    # every id the engine yielded, end-of-turn token included
    reasoning_tokens: int
    cached_tokens: int = 0    # prompt tokens reused from the previous sequence's state (engine/llm.py)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's log-probability in the chat API's shape (its ``logprobs.content`` entry)."""
    entry: dict[str, Any]


def logprob_entry(tokenizer, lp) -> dict[str, Any]:
    """engine.sampling.TokenLogprob -> {"token", "logprob", "bytes", "top_logprobs"} (OpenAI chat)."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        data = tokenizer.token_bytes(token)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": max(logprob, -9999.0),
                "bytes": list(data)}
    return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


class PlainTextParser:
    """Parser for /v1/completions: all text is content."""
    state = CONTENT
    tool_calls = 0

    def feed(self, text: str) -> list[Any]:
        return [TextDelta(CONTENT, text)] if text else []

    def finish(self) -> list[Any]:
        return []


class Job:
    """One request's generation. Events (lists of parser events, then Finished or Failed) go to `events`."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, stops: list[str], parser: Any,
                 loop: asyncio.AbstractEventLoop, constraint=None, snapshot_at: tuple[int, ...] = ()):
        self.prompt_ids = prompt_ids
        self.snapshot_at = snapshot_at        # prompt prefixes worth a state snapshot (server/chat.py cuts)
        self.params = params
        self.constraint = constraint          # a grammar over the generated tokens (engine/constraint.py)
        self.stops = stops
        self.parser = parser
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def post(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:      # the request's event loop is gone: nobody will read this job
            self.cancel()


class GenerationWorker:
    def __init__(self, llm):
        self.llm = llm
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ninfer-generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled:
                continue
            try:
                run_job(self.llm, job)
            except Exception as exc:  # one failed request must not stop the worker
                log.exception("generation failed")
                job.post(Failed(f"generation failed: {type(exc).__name__}: {exc}"))


def run_job(llm, job: Job) -> None:
    tokenizer = llm.tokenizer
    stop_ids = job.params.stop_ids(tokenizer.eos_ids)
    decoder = IncrementalDecoder(tokenizer)
    stops = StopStringFilter(job.stops)
    parser = job.parser
    n_generated = n_reasoning = 0
    reason = "length"
    stream = llm.stream(job.prompt_ids, job.params, job.constraint, snapshot_at=job.snapshot_at)
    with_logprobs = job.params.logprobs is not None
    try:
        for token_id in stream:
            if job.cancelled:
                return
            n_generated += 1
            if parser.state == REASONING:
                n_reasoning += 1
            if token_id in stop_ids:
                reason = "stop"
                break
            events = parser.feed(stops.push(decoder.push(token_id)))
            if with_logprobs:
                events.append(TokenLogprobs(logprob_entry(tokenizer, llm.last_logprobs[n_generated - 1])))
            if events:
                job.post(events)
            if stops.matched is not None:
                reason = "stop"
                break
    finally:
        stream.close()
    tail = stops.push(decoder.flush())
    events = parser.feed(tail + stops.flush()) + parser.finish()
    if events:
        job.post(events)
    if reason == "stop" and parser.tool_calls:
        reason = "tool_calls"
    job.post(Finished(reason, len(job.prompt_ids), n_generated, n_reasoning, llm.last_cached_tokens))
