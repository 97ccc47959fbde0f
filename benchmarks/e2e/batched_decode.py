"""Batched greedy decode in the engine (engine/batched.py), no server: aggregate and per-stream t/s at B
sequences against one stream on the plain runner, on one model file.

    python -m benchmarks.e2e.batched_decode --model models/q35-9b.gguf [--batches 1,2,4,8,16]
        [--prompt 128] [--steps 64] [--out FILE]

One stream: the plain CUDA runner's graph-replayed greedy decode after a --prompt-token prefill (llama-bench's
tg, as `make bench`), median of 3. B streams: B slots of a BatchedDecoder each prefilled with its own
--prompt random tokens, then --steps steps of all B (each step's picks read back before the next, as a
server would), median of 3 runs; step time, aggregate t/s (B / step), per stream (1 / step), each against
one stream. Issue 17's engine-side gate: 16 streams >= 6x one stream's aggregate, each >= 0.35x.
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
    ap.add_argument("--out", help="write the table as JSON here")
    a = ap.parse_args(argv)
    import numpy as np

    from benchmarks.timing import gpu_name
    from ninfer_numba import LLM
    from ninfer_numba.engine.batched import BatchedDecoder
    batches = [int(b) for b in a.batches.split(",")]
    max_seq = a.prompt + 3 * a.steps + 8
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
            first = [dec.prefill(s, rng.integers(0, 1000, a.prompt).tolist()) for s in slots]
            times.append(dec.timed_steps(slots, first, a.steps) / a.steps)
        step = statistics.median(times)
        row = {"B": b, "bucket": dec.bucket(b), "step_ms": step * 1e3, "aggregate_tps": b / step,
               "aggregate_x": one * b / step, "per_stream_tps": 1 / step, "per_stream_x": one / step}
        rows.append(row)
        print(f"{b:3d} {row['bucket']:6d} {step * 1e3:8.3f} {b / step:14.1f} {row['aggregate_x']:6.2f} "
              f"{1 / step:11.1f} {row['per_stream_x']:6.2f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": gpu_name(), "model": a.model, "prompt": a.prompt, "steps": a.steps,
                       "one_stream_ms": one * 1e3, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
