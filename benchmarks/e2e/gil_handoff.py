"""What the GIL's switch interval costs a thread that waits on the GPU while another thread runs Python.

    python -m benchmarks.e2e.gil_handoff [--steps 200] [--gpu-ms 6.3] [--host-ms 0.5]

The server's worker thread waits for a batched step without the GIL (a driver call), then needs it back at
once to hand the tokens over and launch the next step; meanwhile the event loop's thread turns 16 streams'
tokens into SSE chunks, pure Python holding the GIL. Under CPython's default 5 ms switch interval the worker
can wait up to that long per step. Emulated here: the step is a sleep (no GIL, as the driver's wait), the
host work a spin, the event loop a Python loop that never blocks (the worst case); per-step time at several
intervals against the worker alone.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(2000):
            x += i


def _steps(n: int, gpu_s: float, host_s: float) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(gpu_s)
        s = time.perf_counter()
        while time.perf_counter() - s < host_s:
            pass
    return (time.perf_counter() - t0) / n


def per_step(n: int, gpu_s: float, host_s: float, interval: float | None) -> float:
    """Seconds per emulated step; interval None: the worker alone, else beside a busy Python thread."""
    if interval is None:
        return _steps(n, gpu_s, host_s)
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,))
    busy.start()
    try:
        return _steps(n, gpu_s, host_s)
    finally:
        stop.set()
        busy.join()
        sys.setswitchinterval(before)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gpu-ms", type=float, default=6.3, help="the step's GPU time (16 streams, 9B: 6.3 ms)")
    ap.add_argument("--host-ms", type=float, default=0.5, help="the worker's own Python work per step")
    a = ap.parse_args(argv)
    gpu, host = a.gpu_ms / 1e3, a.host_ms / 1e3
    print(f"worker alone: {per_step(a.steps, gpu, host, None) * 1e3:.2f} ms per step")
    for interval in (5e-3, 1e-3, 5e-4, 2e-4):
        print(f"beside a busy Python thread, switch interval {interval * 1e3:.1f} ms: "
              f"{per_step(a.steps, gpu, host, interval) * 1e3:.2f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
