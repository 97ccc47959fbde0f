"""The generation worker: one thread owns the engine; requests wait in a bounded line and run there.

HTTP handlers (on the event loop) never touch the engine: they submit a Job and read its events from an
asyncio queue. Per generated token the worker decodes text (holding back an incomplete UTF-8 character), cuts
at stop strings (holding back a partial one) and runs the output parser (``JobOutput``); the events it posts
are the same for streaming and non-streaming responses, whichever path made the tokens.

Two paths, never at once (on the GPU they share the model's buffers). With batch_slots > 1, greedy jobs go to
the engine's scheduler (server/batching.py) and advance together, one batched step per loop; any other job
runs alone through ``LLM.stream`` when it reaches the head of the line, between two batched steps, while the
batch waits. With batch_slots = 1 every job runs alone, one after another. A cancelled job (client gone) is
skipped if still waiting, stopped at its next token by closing the engine's generator, or has its slot freed
before the next batched step. Handlers mark the requests they are reading and preparing (``arriving``); an
idle batched worker given a greedy job waits for those (ADMIT_WAIT_S at most), so that clients that come
together are admitted together.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ninfer_numba.config import SamplingParams
from ninfer_numba.formats.tokenizer import IncrementalDecoder
from ninfer_numba.server.engine_api import ServedEngine
from ninfer_numba.server.output_parser import CONTENT, REASONING, TextDelta
from ninfer_numba.server.stop_strings import StopStringFilter

log = logging.getLogger("ninfer_numba.server")
# The worker waits for each step without the GIL and must take it back at once to launch the next; the
# event loop's thread meanwhile turns every stream's tokens into SSE chunks, holding the GIL. CPython hands
# the GIL over only every switch interval (default 5 ms): up to 5 ms lost per step. Emulated on the CPU
# (benchmarks/e2e/gil_handoff.py: 6.3 ms step, busy loop beside): 7.3 ms per step alone, 16.2 at 5 ms,
# 9.2 at 0.2 ms.
SWITCH_INTERVAL_S = 2e-4
# An idle batched worker given a greedy job waits this long at most for the requests still being read and
# prepared (arriving): clients that come together are then prefilled together, in one packed forward, not
# one alone and the rest in packs that stall its decode (H200, 9B, 16 streams, session 22 call 3: admissions
# of 1, 1, 3 and 11 prompts). A request that comes alone is not held back. Call 4 (with it) still saw 1, 5
# and 10: the benchmark's clients sent over their own setup (benchmarks/e2e/concurrency.py, since fixed).
ADMIT_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str               # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int    # every id the engine yielded, end-of-turn token included
    reasoning_tokens: int
    cached_tokens: int = 0    # prompt tokens reused from the previous sequence's state (engine/llm.py)
    timings: dict[str, float] | None = None   # milliseconds of the request's phases (JobOutput.finish)


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
                 loop: asyncio.AbstractEventLoop, constraint=None, snapshot_at: tuple[int, ...] = (),
                 received: float | None = None):
        self.prompt_ids = prompt_ids
        # time.perf_counter() when the request arrived (its handler's start), was submitted, and when the
        # engine started on it (run_job; the scheduler's admission on the batched path): JobOutput's timings
        self.received = time.perf_counter() if received is None else received
        self.submitted: float | None = None
        self.started: float | None = None
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
    def __init__(self, llm: ServedEngine, batch_slots: int = 1):
        if batch_slots < 1:
            raise ValueError(f"batch_slots must be >= 1, not {batch_slots}")
        from ninfer_numba.server.batching import BatchedJobs   # it imports this module
        self.llm = llm
        self.batched = BatchedJobs(llm, batch_slots) if batch_slots > 1 else None
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:      # process-wide; a smaller one is kept
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._line: deque[Job] = deque()        # submitted, not yet started or handed to the scheduler
        self._wake = threading.Condition()      # guards _line, _stopping, the places, hand-overs to the scheduler
        # places a job in the line can take without waiting, at the last change: the scheduler's free slots
        # less the sequences it holds that wait for one (greedy jobs, batched path), and 1 while no job runs
        # alone (every other job)
        self._slot_places = batch_slots if self.batched is not None else 0
        self._alone_places = 1
        self._arriving = 0                      # requests being read and prepared (arriving())
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ninfer-generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        job.submitted = time.perf_counter()
        with self._wake:
            self._line.append(job)
            self._wake.notify()

    @contextmanager
    def arriving(self):
        """Around an HTTP handler's reading and preparing of a request, up to its submit(): the idle batched
        worker waits for such requests (ADMIT_WAIT_S at most) before it admits (_gather)."""
        with self._wake:
            self._arriving += 1
        try:
            yield
        finally:
            with self._wake:
                self._arriving -= 1
                self._wake.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish what was submitted, then end the thread (waiting at most timeout seconds)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        if self.batched is not None:             # where the batched path's time went, for the operator
            print(f"ninfer serve: {self.batched.summary()}", file=sys.stderr, flush=True)

    @property
    def queued(self) -> int:
        """Jobs that will wait: those submitted and neither running alone nor holding a slot, beyond the places
        free now (the server's 429 limit). A job the idle worker has not yet picked up, or one that a free slot
        will seat at the next step, is not waiting."""
        with self._wake:
            batchable = sum(1 for job in self._line if self._batchable(job))
            return (max(0, batchable - self._slot_places)
                    + max(0, len(self._line) - batchable - self._alone_places))

    def _batchable(self, job: Job) -> bool:
        return self.batched is not None and self.batched.accepts(job)

    def _warm(self) -> None:
        """The GPU runner's short prefill lengths captured as graphs, for the single path's state and the
        batched decoder's staging state (CudaRunner.warm_prefill), before the first job: a chat turn's rest or
        an admission then replays instead of ~400 launches (~50 ms). Nothing on the CPU backend."""
        warm = getattr(getattr(self.llm, "runner", None), "warm_prefill", None)
        if warm is None:
            return
        try:
            secs = warm()
            if self.batched is not None:
                secs += getattr(self.batched.scheduler.decoder, "warm", lambda: 0.0)()
        except Exception as exc:  # noqa: BLE001  (the lengths then run eagerly: slower, not wrong)
            log.warning("prefill graph warm-up failed: %s", exc)
            return
        print(f"ninfer serve: prefill graphs of the short prompt lengths captured in {secs:.1f} s", file=sys.stderr,
              flush=True)

    def _run(self) -> None:
        self._warm()
        while True:
            job = self._next()
            if job is _STOP:
                return
            if job is not None:
                _run_alone(self.llm, job)
                with self._wake:
                    self._alone_places = 1
            if self.batched is not None and self.batched.busy:
                self.batched.step()               # outside the lock: submit() must not wait for a step
                with self._wake:                  # a step only admits and retires: places only grew
                    self._slot_places = self.batched.places

    def _next(self):
        """Hands the greedy jobs at the head of the line to the scheduler and returns the first other one (to run
        alone now), None when there is none, or _STOP; sleeps while there is nothing to do."""
        with self._wake:
            while not self._line and not self._stopping and not (self.batched is not None and self.batched.busy):
                self._wake.wait()
            self._gather()
            while self._line:
                job = self._line.popleft()
                if job.cancelled:
                    continue
                if not self._batchable(job):
                    self._alone_places = 0
                    return job
                self.batched.add(job)
                self._slot_places = self.batched.places
            idle = self.batched is None or not self.batched.busy
            return _STOP if self._stopping and idle else None

    def _gather(self) -> None:
        """With the lock held: when the scheduler is idle and a greedy job is in the line, wait (ADMIT_WAIT_S
        at most) while other requests are still arriving, so that a burst is admitted at once."""
        if self.batched is None or self.batched.busy or not any(self._batchable(j) for j in self._line):
            return
        deadline = time.perf_counter() + ADMIT_WAIT_S
        while self._arriving and not self._stopping:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wake.wait(left)


_STOP = object()


def _run_alone(llm, job: Job) -> None:
    try:
        run_job(llm, job)
    except Exception as exc:  # one failed request must not stop the worker
        log.exception("generation failed")
        job.post(Failed(f"generation failed: {type(exc).__name__}: {exc}"))


class JobOutput:
    """A job's generated tokens -> its events: text, stop strings, the output parser, then Finished."""

    def __init__(self, tokenizer, job: Job):
        self.job = job
        self.tokenizer = tokenizer
        self.stop_ids = job.params.stop_ids(tokenizer.eos_ids)
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopStringFilter(job.stops)
        self.n_generated = self.n_reasoning = 0
        self.stopped = False      # a stop token or a stop string ended the text
        self.first_at = self.last_at = None   # time.perf_counter() of the first and the last token

    def push(self, token_id: int, logprob=None) -> bool:
        """One generated token (with its engine.sampling.TokenLogprob when the job asked for logprobs); True
        once the text has ended."""
        self.n_generated += 1
        self.last_at = time.perf_counter()
        if self.first_at is None:
            self.first_at = self.last_at
        if self.job.parser.state == REASONING:
            self.n_reasoning += 1
        if token_id in self.stop_ids:
            self.stopped = True
            return True
        events = self.job.parser.feed(self.stops.push(self.decoder.push(token_id)))
        if logprob is not None:
            events.append(TokenLogprobs(logprob_entry(self.tokenizer, logprob)))
        if events:
            self.job.post(events)
        self.stopped = self.stops.matched is not None
        return self.stopped

    def finish(self, cached_tokens: int) -> None:
        """The held-back text and the parser's last events, then Finished ("length" unless the text ended),
        with the request's timings."""
        parser = self.job.parser
        tail = self.stops.push(self.decoder.flush())
        events = parser.feed(tail + self.stops.flush()) + parser.finish()
        if events:
            self.job.post(events)
        reason = "length" if not self.stopped else "tool_calls" if parser.tool_calls else "stop"
        self.job.post(Finished(reason, len(self.job.prompt_ids), self.n_generated, self.n_reasoning,
                               cached_tokens, self.timings()))

    def timings(self) -> dict[str, float] | None:
        """Milliseconds between the request's marks: prepare (arrival to submission: parsing, the template,
        tokenization), queue (to the engine starting on it), prefill (to its first token: cache restore,
        prompt forwards, snapshots), decode (first to last token); first_token is their first three summed.
        None when a mark is missing (no token was made)."""
        job = self.job
        marks = (job.received, job.submitted, job.started, self.first_at, self.last_at)
        if any(m is None for m in marks):
            return None
        ms = [round((b - a) * 1e3, 3) for a, b in zip(marks, marks[1:])]
        return {"prepare_ms": ms[0], "queue_ms": ms[1], "prefill_ms": ms[2], "decode_ms": ms[3],
                "first_token_ms": round((self.first_at - job.received) * 1e3, 3)}


def run_job(llm, job: Job) -> None:
    """The job alone on the engine's single-sequence path (LLM.stream)."""
    out = JobOutput(llm.tokenizer, job)
    with_logprobs = job.params.logprobs is not None
    job.started = time.perf_counter()
    stream = llm.stream(job.prompt_ids, job.params, job.constraint, snapshot_at=job.snapshot_at)
    try:
        for token_id in stream:
            if job.cancelled:
                return
            if out.push(token_id, llm.last_logprobs[out.n_generated] if with_logprobs else None):
                break
    finally:
        stream.close()
    out.finish(llm.last_cached_tokens)
