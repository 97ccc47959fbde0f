"""CUDA graphs on a numba stream: capture a sequence of launches once, replay it with one call.

A numba launch costs 20-37 µs of host time, longer than most decode kernels: the engine replays its
decode step (and repeated prefill chunk lengths) from graphs (engine/cuda_runner.py), and the kernel
benchmarks time graphs of many launches (benchmarks/timing.py). Raw driver capture on a numba stream,
reference/numba-cuda.md §5.
"""
from __future__ import annotations

import gc

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
