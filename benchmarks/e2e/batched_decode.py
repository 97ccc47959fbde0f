"""Batched greedy decode in the engine (engine/batched.py), no server: aggregate and per-stream t/s at B
sequences against one stream on the plain runner, on one model file.

    python -m benchmarks.e2e.batched_decode --model models/q35-9b.gguf [--batches 1,2,4,8,16]
        [--prompt 128] [--steps 64] [--profile 16] [--out FILE]

One stream: the plain CUDA runner's graph-replayed greedy decode after a --prompt-token prefill (llama-bench's
tg, as `make bench`), median of 3. B streams: B slots of a BatchedDecoder each prefilled with its own
--prompt random tokens, then --steps steps of all B (each step's picks read back before the next, as a
server would), median of 3 runs; step time, aggregate t/s (B / step), per stream (1 / step), each against
one stream. Issue 17's engine-side gate: 16 streams >= 6x one stream's aggregate, each >= 0.35x. --profile B: then every kernel of one B-row step timed alone
(benchmarks.e2e.decode_profile's table), beside the one-stream step's.
"""
from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile", type=int, help="then time each kernel of a step of this many rows alone")
    ap.add_argument("--out", help="write the table as JSON here")
    a = ap.parse_args(argv)
    import numpy as np

    from benchmarks.timing import gpu_name
    from ninfer_numba import LLM
    from ninfer_numba.engine.batched import BatchedDecoder
    batches = [int(b) for b in a.batches.split(",")]
    # a profile replays each kernel ~140 times alone, some of them advancing positions: room for that
    max_seq = a.prompt + 3 * a.steps + 8 + (1024 if a.profile else 0)
    llm = LLM(a.model, backend="cuda", max_seq=max_seq, prefix_cache_mb=0)
    one = statistics.median(llm.bench_decode(a.steps, a.prompt) for _ in range(3)) / a.steps
    print(f"{gpu_name()}; {a.model}; prompt {a.prompt}, {a.steps} steps")
    print(f"one stream (plain runner): {one * 1e3:.3f} ms per token, {1 / one:.1f} t/s", flush=True)
    dec = BatchedDecoder(llm.runner.model, max(batches), max_seq)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'B':>3} {'bucket':>6} {'step ms':>8} {'aggregate t/s':>14} {'x one':>6} {'per stream':>11} {'x one':>6}")
    for b in batches:
        slots = list(range(b))
        times = []
        for _ in range(3):
            for s in slots:
                dec.reset(s)                        # each run starts the slots empty
            first = [dec.prefill(s, rng.integers(0, 1000, a.prompt).tolist()) for s in slots]
            times.append(dec.timed_steps(slots, first, a.steps) / a.steps)
        step = statistics.median(times)
        row = {"B": b, "bucket": dec.bucket(b), "step_ms": step * 1e3, "aggregate_tps": b / step,
               "aggregate_x": one * b / step, "per_stream_tps": 1 / step, "per_stream_x": one / step}
        rows.append(row)
        print(f"{b:3d} {row['bucket']:6d} {step * 1e3:8.3f} {b / step:14.1f} {row['aggregate_x']:6.2f} "
              f"{1 / step:11.1f} {row['per_stream_x']:6.2f}", flush=True)
    profile = _profile(llm, dec, a.profile) if a.profile else None
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": gpu_name(), "model": a.model, "prompt": a.prompt, "steps": a.steps,
                       "one_stream_ms": one * 1e3, "rows": rows, "profile": profile}, f, indent=1)
    return 0


def _profile(llm, dec, b: int) -> dict:
    """Every kernel of one eager b-row step (slots 0..b-1) and of the one-stream step, each timed alone."""
    from benchmarks.e2e.decode_profile import copy_gbps, kernel_rows, print_kernel_rows, record_step
    copy = copy_gbps()
    out = {}
    for name, launches in (("one stream", record_step(llm.runner)), (f"{b} rows", _record_rows(dec, b))):
        rows = kernel_rows(launches)
        total = sum(r["us"] for r in rows)
        print(f"\n{name}: {len(launches)} launches, {total:.1f} us summed alone")
        print_kernel_rows(rows, copy, limit=14)
        out[name] = {"kernels_us": total, "rows": rows}
    return out


def _record_rows(dec, b: int) -> list[tuple]:
    """Every launch of one eager b-row step over slots 0..b-1, emptied first."""
    from benchmarks.e2e.decode_profile import record_launches
    for s in range(b):
        dec.reset(s)
    rows = dec.states.rows(dec.bucket(b))
    rows.set_rows(list(range(b)), pad=dec.pad)
    return record_launches(lambda: dec._kernels(dec.bucket(b)), dec.stream)


if __name__ == "__main__":
    raise SystemExit(main())
