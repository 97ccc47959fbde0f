"""Kernel timing on the GPU: CUDA graphs replayed between CUDA events.

A numba launch costs 20-37 µs of host time, longer than most decode kernels, so timing a Python loop of
launches measures the host. ``time_graph`` captures ``n_inner`` calls of a launch function into one CUDA
graph (engine/graphs.py) and times whole replays with events; medians over ``reps`` replays are reported.
Callers rotate among several buffer sets inside the launch function when the working set would otherwise
sit in the 60 MB L2.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from ninfer_numba.engine.graphs import CudaGraph
from ninfer_numba.kernels.numba_env import cuda


@dataclass(frozen=True)
class GraphTiming:
    median_ms: float        # per call of the launch function (replay time / n_inner)
    samples_ms: list[float]
    capture_s: float        # host seconds spent capturing and instantiating


def time_graph(launch: Callable[[object], None], *, n_inner: int = 20, reps: int = 10,
               warmup: int = 3, stream=None) -> GraphTiming:
    """Median device time of one ``launch(stream)`` call, from CUDA-graph replays timed by events.

    ``launch`` enqueues its kernels on the stream it is given. It is called once eagerly (compile and
    load), then ``n_inner`` times under capture; each replay is bracketed by events.
    """
    stream = stream or cuda.stream()
    launch(stream)
    stream.synchronize()
    t0 = time.perf_counter()
    graph = CudaGraph(stream)
    with graph.capture():
        for _ in range(n_inner):
            launch(stream)
    capture_s = time.perf_counter() - t0
    for _ in range(warmup):
        graph.launch()
    stream.synchronize()
    start, stop = cuda.event(), cuda.event()
    samples = []
    for _ in range(reps):
        start.record(stream)
        graph.launch()
        stop.record(stream)
        stop.synchronize()
        samples.append(cuda.event_elapsed_time(start, stop) / n_inner)
    graph.close()
    return GraphTiming(statistics.median(samples), samples, capture_s)


def gpu_name() -> str:
    """The current CUDA device's name (numba returns bytes on some versions)."""
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def append_jsonl(path: str | None, rows: list[dict], **fields) -> None:
    """Append each row, with ``fields`` added to it, as one JSON line to ``path`` (nothing when None)."""
    if not path:
        return
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps({**fields, **r}) + "\n")
