"""pytest-benchmark plumbing shared by the kernel microbenchmarks (benchmarks/kernels/bench_<family>.py).

    .venv/bin/python -m pytest benchmarks/kernels [-k gemv] [--benchmark-json=gemv.json]

A microbenchmark builds its buffers, then hands ``kernel_bench`` a ``launch(stream)`` function and the work
of one call. Each round replays a CUDA graph of ``n_inner`` captured calls and is timed with CUDA events
(benchmarks.timing.time_graph): a launch from Python costs 20-37 µs of host time, longer than most
decode kernels, so wall-clock timing would measure the host. ``rotated`` cycles the captured calls through
several buffer sets so a working set smaller than L2 is not served from it. pytest-benchmark's table then
shows per-call device times, and each result's extra_info carries GB/s and int8 TOPS against the measured
ceilings (benchmarks/ceilings.py). Without a GPU every benchmark here is skipped.

    def test_gemv_9b_ffn_down(kernel_bench, l2_bytes):
        sets = [make_buffers() for _ in range(copies_to_defeat_l2(bytes_per_set, l2_bytes))]
        kernel_bench(rotated(lambda stream, w, x, y: gemv[grid, block, stream](w, x, y), sets),
                     bytes_moved=bytes_per_set, int8_ops=2 * rows * cols)
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Callable, Sequence

import pytest

from benchmarks.ceilings import kernel_throughput, measure_ceilings
from ninfer_numba.kernels.numba_env import gpu_available

HERE = Path(__file__).resolve().parent


def pytest_collect_file(file_path: Path, parent):
    """Collect bench_*.py here as test modules (the project's python_files pattern only names test_*.py)."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and file_path.parent == HERE:
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="kernel microbenchmarks need a CUDA GPU")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


class ReplayClock:
    """A clock that moves only by recorded CUDA-event times. pytest-benchmark reads its timer before and
    after each round; the round (``advance``) moves the clock by the next sample, so every round's duration
    is exactly one event-timed graph replay."""

    def __init__(self, samples_s: Sequence[float]) -> None:
        if not samples_s:
            raise ValueError("no samples to replay")
        self._samples = list(samples_s)
        self._next = 0
        self._now = 0.0

    def __call__(self) -> float:
        return self._now

    def advance(self) -> None:
        self._now += self._samples[self._next % len(self._samples)]
        self._next += 1


def rotated(launch_one: Callable, buffer_sets: Sequence[tuple]) -> Callable:
    """``launch(stream)`` calling ``launch_one(stream, *buffer_sets[i])`` with i advancing on every call; the
    graph captured from n_inner calls then walks through all sets in turn."""
    if not buffer_sets:
        raise ValueError("need at least one buffer set")
    counter = itertools.count()

    def launch(stream) -> None:
        launch_one(stream, *buffer_sets[next(counter) % len(buffer_sets)])

    return launch


def copies_to_defeat_l2(bytes_per_set: int, l2_bytes: int, factor: int = 4) -> int:
    """Buffer sets needed so the sets visited between two uses of one set exceed ``factor`` × L2."""
    return max(1, math.ceil(factor * l2_bytes / max(1, bytes_per_set)) + 1)


@pytest.fixture(scope="session")
def ceilings() -> dict:
    """Measured copy bandwidth and int8 GEMM rate (nulls when neither torch nor cupy is installed)."""
    return measure_ceilings()


@pytest.fixture(scope="session")
def l2_bytes() -> int:
    from ninfer_numba.kernels.numba_env import cuda
    return int(cuda.get_current_device().L2_CACHE_SIZE)


@pytest.fixture
def kernel_bench(benchmark, ceilings):
    """``kernel_bench(launch, *, bytes_moved=None, int8_ops=None, n_inner=20, rounds=10, warmup=3) -> dict``:
    time ``launch`` in CUDA-graph replays, record the rounds in pytest-benchmark and return GB/s, TOPS and
    their fractions of the ceilings (also stored in ``benchmark.extra_info``). Work is per call of launch."""
    from benchmarks.timing import time_graph

    def run(launch: Callable, *, bytes_moved: float | None = None, int8_ops: float | None = None,
            n_inner: int = 20, rounds: int = 10, warmup: int = 3) -> dict:
        timing = time_graph(launch, n_inner=n_inner, reps=rounds, warmup=warmup)
        clock = ReplayClock([ms / 1e3 for ms in timing.samples_ms])
        if not hasattr(benchmark, "_timer"):
            raise RuntimeError("this pytest-benchmark version has no BenchmarkFixture._timer to replay event times")
        benchmark._timer = clock   # read per round by pytest-benchmark's runner (checked on 5.3)
        benchmark.pedantic(clock.advance, rounds=len(timing.samples_ms), iterations=1, warmup_rounds=0)
        report = kernel_throughput(timing.median_ms / 1e3, ceilings, bytes_moved=bytes_moved, int8_ops=int8_ops)
        benchmark.extra_info.update({"median_ms": timing.median_ms, "capture_s": timing.capture_s,
                                     "n_inner": n_inner, **report,
                                     "copy_ceiling_gbps": ceilings.get("copy_gbps"),
                                     "int8_ceiling_tops": ceilings.get("int8_tops")})
        print(f"{timing.median_ms * 1e3:.1f} us/call" + "".join(
            f", {report[k]:.4g} {unit} ({report[f]:.0%} of ceiling)" if report[f] is not None else
            f", {report[k]:.4g} {unit}" for k, f, unit in (("gbps", "copy_fraction", "GB/s"),
                                                         ("tops", "int8_fraction", "int8 TOPS"))
            if report[k] is not None))
        return report

    return run
