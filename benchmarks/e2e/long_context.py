"""Decode at a long depth after one prefill: a model near its full context with a chosen KV cache type (the
27B at 262,144 tokens with k3v3 in one H200's memory).

    python -m benchmarks.e2e.long_context --model models/q35-27b.gguf --kv-type k3v3 [--depth N]
        [--fill N] [--gen 128] [--reps 3] [--piece 16384] [--prefill-chunk 8192] [--backend cuda] [--out r.json]

`make bench`'s tgN@dD prefills the depth again before every repetition (llama-bench's semantics), which at
262,144 tokens costs minutes each; here the depth (default: the model's context less gen·reps, so the
slots hold exactly its context) is prefilled once, in pieces of --piece tokens with a
progress line after each, then --reps decodes of --gen tokens follow one another (repetition r starts at
depth + r·gen: 0.15 % deeper per repetition at 262K). Reported: the prefill's t/s, each repetition's decode
t/s and their median, the KV memory as allocated (LLM.describe()) beside ``ninfer info``'s formula, and the
device memory in use.

--fill N puts the first N tokens of the depth in the cache without a prefill (random keys and values:
SequenceState.fill_random; the GDN states those of an empty sequence), and prefills only the rest, at depth
N: a 27B prefill of 262,144 tokens is ~1.35e17 FLOPs of attention alone, past what one timed run allows,
while a decode step's work does not depend on the cached values. The report says how much was filled.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def device_memory_used() -> int | None:
    """Bytes in use on the current GPU (all processes), or None without one."""
    from ninfer_numba.kernels.numba_env import gpu_available
    if not gpu_available():
        return None
    from ninfer_numba.kernels.numba_env import cuda
    free, total = cuda.current_context().get_memory_info()
    return int(total - free)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-type", default="k3v3")
    ap.add_argument("--depth", type=int, default=None, help="default: the context length less gen x reps")
    ap.add_argument("--fill", type=int, default=0, help="tokens of the depth filled at random, not prefilled")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--piece", type=int, default=16384, help="prefill tokens between progress lines")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill forward (EngineConfig)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from ninfer_numba import LLM
    from ninfer_numba.engine.cache import kv_memory_bytes
    from ninfer_numba.model.weights import open_model
    if a.depth is None:
        a.depth = open_model(a.model).config.context_length - a.gen * a.reps
    if a.depth < 1 or a.gen < 1 or a.reps < 1 or a.piece < 1 or not 0 <= a.fill < a.depth:
        raise SystemExit("--depth, --gen, --reps and --piece must be at least 1 (and the depth inside the context), "
                         "--fill in [0, depth)")
    max_seq = a.depth + a.gen * a.reps
    t0 = time.perf_counter()
    llm = LLM(a.model, backend=a.backend, max_seq=max_seq, kv_type=a.kv_type, prefill_chunk=a.prefill_chunk)
    described = llm.describe()
    log(f"loaded {a.model} ({a.backend}, kv {a.kv_type}, max_seq {max_seq:,}) in {time.perf_counter() - t0:.1f} s")
    formula = kv_memory_bytes(llm.config, a.kv_type, max_seq)
    report = {"model": a.model, "backend": a.backend, "kv_type": a.kv_type, "depth": a.depth, "gen": a.gen,
              "prefill_chunk": a.prefill_chunk, "filled": a.fill,
              "max_seq": max_seq, "kv_cache_bytes": described.get("kv_cache_bytes"),
              "kv_formula_bytes": formula}
    rng = np.random.default_rng(a.seed)
    ids = rng.integers(0, llm.config.n_vocab, a.depth - a.fill).tolist()
    runner = llm.runner
    if a.fill:
        t0 = time.perf_counter()
        runner.fill_random(a.fill, seed=a.seed)
        log(f"filled {a.fill:,} tokens of cache at random in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    for start in range(0, len(ids), a.piece):
        runner.prefill(ids[start:start + a.piece])
        done, secs = a.fill + min(len(ids), start + a.piece), time.perf_counter() - t0
        log(f"prefilled {done - a.fill:,} of {len(ids):,} tokens (depth {done:,}) in {secs:.1f} s "
            f"({(done - a.fill) / secs:,.0f} t/s)")
    report["prefill_seconds"] = time.perf_counter() - t0
    report["prefill_tps"] = len(ids) / report["prefill_seconds"]
    report["device_memory_used_bytes"] = device_memory_used()
    token = int(rng.integers(0, llm.config.n_vocab))
    tps = []
    for r in range(a.reps):
        tps.append(a.gen / runner.timed_decode(token, a.gen))
        log(f"decode rep {r + 1}/{a.reps} from depth {a.depth + r * a.gen:,}: {tps[-1]:.1f} t/s")
    report["decode_tps"] = tps
    report["decode_tps_median"] = statistics.median(tps)
    gb = lambda b: "n/a" if b is None else f"{b / 1e9:.2f} GB"       # noqa: E731
    filled = f" ({a.fill:,} of them filled at random)" if a.fill else ""
    print(f"{a.model}: kv {a.kv_type} at {a.depth:,} tokens{filled}: cache {gb(report['kv_cache_bytes'])} "
          f"(formula {gb(formula)}); device memory in use {gb(report['device_memory_used_bytes'])}; prefill of "
          f"{len(ids):,} tokens {report['prefill_tps']:,.0f} t/s; decode {report['decode_tps_median']:.1f} t/s "
          f"(median of {a.reps})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
