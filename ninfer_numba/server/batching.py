"""The worker's batched path: greedy jobs as sequences of the engine's scheduler (engine/scheduler.py).

A job qualifies when each of its tokens is the argmax of the raw logits (temperature 0, no penalty), with no
grammar and no logprobs: the greedy picks of a batched step are then exactly its tokens. Every other job runs
alone (server/worker.py). Each token a step makes goes through the job's JobOutput as on the single path; a
stop string retires the sequence at once, a cancelled job's sequence before the next step. A step that raises
fails every sequence it held (the scheduler cannot tell whose fault it was); those still waiting carry on.
"""
from __future__ import annotations

import logging
import time

from ninfer_numba.engine.scheduler import Sequence
from ninfer_numba.server.engine_api import BatchingEngine
from ninfer_numba.server.worker import Failed, Job, JobOutput

log = logging.getLogger("ninfer_numba.server")


class BatchedJobs:
    """The scheduler's sequences and the jobs they belong to; used by the worker thread alone."""

    def __init__(self, llm: BatchingEngine, n_slots: int):
        self.scheduler = llm.scheduler(n_slots)
        self.tokenizer = llm.tokenizer
        self._jobs: dict[Sequence, JobOutput] = {}     # unfinished sequences -> their job's output side
        self.text_seconds = 0.0                        # in the jobs' text, stop strings, parsers and events

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def places(self) -> int:
        """Free slots less the sequences waiting for one: negative when more wait than the slots can seat."""
        return self.scheduler.slots.count(None) - len(self.scheduler.waiting)

    def accepts(self, job: Job) -> bool:
        p = job.params
        return p.is_plain_greedy and p.logprobs is None and job.constraint is None and p.max_tokens >= 1

    def add(self, job: Job) -> None:
        out = JobOutput(self.tokenizer, job)
        seq = Sequence(list(job.prompt_ids), job.params.max_tokens, out.stop_ids, tuple(job.snapshot_at))
        try:
            self.scheduler.add(seq)
        except ValueError as exc:
            job.post(Failed(f"generation failed: ValueError: {exc}"))
            return
        self._jobs[seq] = out

    def step(self) -> None:
        """Cancelled jobs' sequences retired, then one scheduler step, its tokens delivered."""
        for seq, out in list(self._jobs.items()):
            if out.job.cancelled:
                self.scheduler.cancel(seq)
                del self._jobs[seq]
        try:
            made = self.scheduler.step()
        except Exception as exc:  # the engine failed: fail what it was running, keep the worker alive
            log.exception("batched step failed")
            for seq in self.scheduler.abort():
                self._jobs.pop(seq).job.post(Failed(f"generation failed: {type(exc).__name__}: {exc}"))
            return
        t0 = time.perf_counter()
        self._deliver(made)
        self.text_seconds += time.perf_counter() - t0

    def summary(self) -> str:
        """The scheduler's line and the seconds its tokens took on the output side."""
        return f"batched decode: {self.scheduler.summary()}; the tokens' text and events {self.text_seconds:.3f} s"

    def _deliver(self, made) -> None:
        for seq, token in made:
            out = self._jobs.get(seq)
            if out is None or out.job.cancelled:     # ended earlier in this step, or retired before the next
                continue
            if out.job.started is None:              # the engine started on it at its admission
                out.job.started = seq.admitted_at
            try:
                ended = out.push(token)
            except Exception as exc:  # this job's text could not be made: it alone fails
                log.exception("generation failed")
                self.scheduler.cancel(seq)
                del self._jobs[seq]
                out.job.post(Failed(f"generation failed: {type(exc).__name__}: {exc}"))
                continue
            if ended and not seq.finished:           # a stop string: the slot is free for the next step
                self.scheduler.cancel(seq, "stop")
            if seq.finished:
                del self._jobs[seq]
                out.finish(seq.cached_tokens)
