"""Timing on the GPU: CUDA graphs replayed between CUDA events.

A numba launch costs 20-37 µs of host time, longer than most decode kernels, so timing a Python loop of
launches measures the host. ``time_graph`` captures ``n_inner`` calls of a launch function into one CUDA
graph (raw driver capture on a numba stream, reference/numba-cuda.md §5) and times whole replays with
events; medians over ``reps`` replays are reported. Callers rotate among several buffer sets inside the
launch function when the working set would otherwise sit in the 60 MB L2.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from ninfer_numba.kernels.numba_env import cuda


def _check(result) -> object:
    """cuda.bindings calls return (CUresult, *values); raise on any error code."""
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return result[1] if len(result) == 2 else result[1:]


_capturing = 0                  # captures in progress in this process
_doomed: list = []              # graphs dropped during a capture, destroyed once it ends


class CudaGraph:
    """A captured sequence of launches on one numba stream, replayable with ``launch()``.

    Usage: ``g = CudaGraph(stream); with g.capture(): kernels...[grid, block, stream](...)``; then
    ``g.launch()``. Every kernel must have run once before capture (compilation and module load are not
    capturable) and nothing inside may allocate or free. Python's garbage collector is paused during a
    capture, and a graph released meanwhile is destroyed after it: collecting an old engine there would
    free device memory or destroy its graphs, which invalidates the capture.
    """

    def __init__(self, stream) -> None:
        from cuda.bindings import driver as cu
        self._cu = cu
        self.stream = stream
        self._graph = None
        self._exec = None

    def capture(self):
        graph = self

        class _Capture:
            def __enter__(self_inner):
                global _capturing
                cu = graph._cu
                self_inner._gc = gc.isenabled()
                gc.disable()
                _capturing += 1
                self_inner._defer = cuda.defer_cleanup()
                self_inner._defer.__enter__()
                _check(cu.cuStreamBeginCapture(graph._handle(),
                                               cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
                return graph

            def __exit__(self_inner, exc_type, exc, tb):
                cu = graph._cu
                try:
                    g = _check(cu.cuStreamEndCapture(graph._handle()))
                    if exc_type is None:
                        graph._graph = g
                        graph._exec = _check(cu.cuGraphInstantiate(g, 0))
                finally:
                    global _capturing
                    self_inner._defer.__exit__(exc_type, exc, tb)
                    _capturing -= 1
                    if self_inner._gc:
                        gc.enable()
                    while _capturing == 0 and _doomed:
                        _doomed.pop().close()
                return False

        return _Capture()

    def _handle(self):
        h = self.stream.handle
        return h.value if hasattr(h, "value") else int(h)

    def launch(self) -> None:
        if self._exec is None:
            raise RuntimeError("graph not captured")
        _check(self._cu.cuGraphLaunch(self._exec, self._handle()))

    def close(self) -> None:
        cu = self._cu
        if self._exec is not None:
            cu.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._graph is not None:
            cu.cuGraphDestroy(self._graph)
            self._graph = None

    def __del__(self):  # graphs hold driver resources; free them with the object (after any capture)
        if _capturing:
            replacement = CudaGraph.__new__(CudaGraph)
            replacement.__dict__.update(self.__dict__)
            _doomed.append(replacement)
            return
        try:
            self.close()
        except Exception:
            pass


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
