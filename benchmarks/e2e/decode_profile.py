"""Where a decode step's time goes: every kernel of one decode step timed alone, against the bytes it is
passed at copy bandwidth, next to the step's own time (the decode issue's first table).

    python -m benchmarks.e2e.decode_profile --model models/q35-9b.gguf [--depth 0] [--out profile.json]
        [--kv-type k3v3] [--kvq-partial lanes|tokens|mma|auto] [--cold]

The launches of one eager decode step (the graph's forward and argmax) are recorded by wrapping numba's
launch call (kernel, grid, block, dynamic shared memory, arguments). Each is then replayed alone from a CUDA
graph of 20 copies (benchmarks.timing.time_graph). Bytes are those of the device arrays a launch is passed:
exact for weights (read whole), an upper bound for caches passed whole and read to the position. Alone, a
kernel whose arrays fit in the 60 MB L2 reads them from L2 after the first copy, so its time is a lower
bound; the weight GEMVs (tens of MB each) are not affected. --cold writes 128 MB before each copy (its
own time subtracted), so every kernel reads from DRAM as in the step. The step: the runner's decode graph replayed
with the token read back each step (as llama-bench times tg). The gap between the step and the sum of the
kernels is graph-node overhead, gaps between dependent kernels and the host round trip.

The replays change the sequence state (each position advance runs hundreds of times); the engine is made
with room for that and is not used for generation afterwards.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import numpy as np

from ninfer_numba.config import KV_CACHE_TYPES, KVQ_PARTIALS
from ninfer_numba.kernels.numba_env import cuda


def record_launches(enqueue, stream) -> list[tuple]:
    """(dispatcher, grid, block, sharedmem, args) of every launch enqueue() makes (eagerly, on stream)."""
    import numba.cuda.dispatcher as nd
    launches, original = [], nd._LaunchConfiguration.__call__

    def recording(self, *args):
        launches.append((self.dispatcher, self.griddim, self.blockdim, self.sharedmem, args))
        return original(self, *args)
    nd._LaunchConfiguration.__call__ = recording
    try:
        enqueue()
        stream.synchronize()
    finally:
        nd._LaunchConfiguration.__call__ = original
    return launches


def record_step(runner) -> list[tuple]:
    """Every launch of one eager decode step of a CUDA runner."""
    runner._set_token(1)
    return record_launches(lambda: runner._decode_step_kernels(sampled=False), runner.stream)


def copy_gbps() -> float:
    """The measured copy bandwidth the %copy column divides by (4,250 GB/s where it cannot be measured)."""
    from benchmarks.ceilings import measure_ceilings
    return measure_ceilings()["copy_gbps"] or 4250.0


FLUSH_BYTES = 128 << 20     # written before each kernel with --cold: over twice the H200's 50 MB of L2


@cuda.jit
def _fill_zero(a):
    # a: [n] float32, every element written (grid-stride)
    i = cuda.grid(1)
    while i < a.size:
        a[i] = 0.0
        i += cuda.gridsize(1)


def l2_flush():
    """A launch(stream) that writes FLUSH_BYTES, evicting from L2 what the kernels before it read."""
    buf = cuda.device_array(FLUSH_BYTES // 4, np.float32)       # [FLUSH_BYTES / 4] float32, overwritten
    return lambda s: _fill_zero[1024, 256, s](buf)


def kernel_rows(launches, cold: bool = False) -> list[dict]:
    """Each kernel's launches replayed alone from a graph of 20 copies: per kernel name, launches, µs summed
    and bytes passed, slowest first. cold: each copy follows an L2 flush (l2_flush, its own time measured
    alone and subtracted), so a kernel reads its arrays from DRAM as in the step, where the weights read in
    between evict them; warm (default), arrays under ~50 MB stay in L2 across the copies."""
    from benchmarks.timing import time_graph
    flush = l2_flush() if cold else None
    flush_ms = time_graph(flush, n_inner=20, reps=5).median_ms if cold else 0.0
    per_kernel = defaultdict(lambda: {"launches": 0, "us": 0.0, "bytes": 0})
    for disp, grid, block, shmem, args in launches:
        def launch(s, disp=disp, grid=grid, block=block, shmem=shmem, args=args):
            if flush is not None:
                flush(s)
            disp[grid, block, s, shmem](*args)
        ms = time_graph(launch, n_inner=20, reps=5).median_ms - flush_ms
        row = per_kernel[disp.py_func.__qualname__.replace(".<locals>.", ":")]
        row["launches"] += 1
        row["us"] += 1e3 * ms
        row["bytes"] += device_bytes(args)
    return sorted(({"kernel": k, **v} for k, v in per_kernel.items()), key=lambda r: -r["us"])


def print_kernel_rows(rows: list[dict], copy_gbps: float, limit: int | None = None) -> None:
    total = sum(r["us"] for r in rows)
    print(f"{'kernel':58s} {'n':>4s} {'us':>9s} {'share':>6s} {'MB':>9s} {'GB/s':>7s} {'%copy':>6s}")
    for r in rows[:limit]:
        gbs = r["bytes"] / (r["us"] * 1e3) if r["us"] else float("nan")
        print(f"{r['kernel'][:58]:58s} {r['launches']:4d} {r['us']:9.1f} {100 * r['us'] / total:5.1f}% "
              f"{r['bytes'] / 1e6:9.2f} {gbs:7.0f} {100 * gbs / copy_gbps:5.1f}%")


def device_bytes(args) -> int:
    return sum(a.nbytes for a in args if cuda.is_cuda_array(a))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=0, help="tokens in the cache before the step")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--no-pdl", action="store_true", help="decode graphs without programmatic launches")
    ap.add_argument("--kv-type", default="f16", choices=KV_CACHE_TYPES, help="the KV cache's type")
    ap.add_argument("--kvq-partial", default=None, choices=KVQ_PARTIALS,
                    help="a coded cache's decode partial (EngineConfig's default unless given)")
    ap.add_argument("--cold", action="store_true",
                    help="time each kernel after a 128 MB write that evicts L2 (its arrays from DRAM)")
    a = ap.parse_args(argv)
    from ninfer_numba import LLM
    extra = {} if a.kvq_partial is None else {"kvq_partial": a.kvq_partial}
    llm = LLM(a.model, backend="cuda", max_seq=a.depth + 4096, prefix_cache_mb=0, pdl=not a.no_pdl,
              kv_type=a.kv_type, **extra)
    step_ms = 1e3 * llm.bench_decode(64, a.depth) / 64
    copy = copy_gbps()
    runner = llm.runner
    launches = record_step(runner)
    rows = kernel_rows(launches, a.cold)
    total = sum(r["us"] for r in rows)
    print(f"kv {a.kv_type}{'' if a.kvq_partial is None else ' (' + a.kvq_partial + ' partial)'}: "
          f"decode step at depth {a.depth}: {step_ms * 1e3:.1f} us per token (graph replay + token read); "
          f"{len(launches)} kernels, {total:.1f} us summed alone{' from a cold L2' if a.cold else ''}; gap "
          f"{step_ms * 1e3 - total:.1f} us; copy {copy:,.0f} GB/s")
    print_kernel_rows(rows, copy)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "depth": a.depth, "kv_type": a.kv_type, "kvq_partial": a.kvq_partial,
                       "cold_l2": a.cold, "step_us": step_ms * 1e3, "kernels_us": total, "copy_gbps": copy,
                       "rows": rows,
                       "median_us_per_launch": statistics.median([r["us"] / r["launches"] for r in rows])},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
