"""The split by layers on one GPU (engine/sharded_runner.py): what the pinned-host bridge costs, and whether
the prefill chunks pipeline through the shards.

    python -m benchmarks.e2e.shard_bridge --model models/q35-9b.gguf [--prompt 8192] [--gen 64] [--shards 2]
        [--check 2,4 | --check none]

First (--check) the split against the plain cuda runner on this file: 2 and 4 shards on GPU 0 must give the
same logits bit for bit on a 200-token prompt in chunks of 64 (both bridge parities, a short last chunk) and
the same 16 greedy tokens (decode_greedy: the last shard's device argmax). Then it runs the model as one shard and as --shards shards on GPU 0 (the same runner: eager prefill chunks, one
graph per shard per decode step), and the plain cuda runner beside them. Prints the prefill time of --prompt
tokens and the decode time per token (medians of 3), the difference between the split and the single shard
(the bridge: hand-offs through host memory, event waits, one more graph per step), and from one traced
prefill each shard's busy time per chunk and how much of it overlapped the other shards' (pipelining).
Last, the bridge's own cost: one hand-off (device -> portable pinned host buffer -> device, the runner's
copies) of a decode token's hidden row [1, n_embd] and of a prefill chunk [prefill_chunk, n_embd] float32,
in µs and GB/s, and how much of the measured bridge difference those copies account for.
"""
from __future__ import annotations

import argparse
import statistics

HANDOFFS_PER_REPLAY, REPLAYS = 50, 20     # one graph replays 50 hand-offs; the median of 20 replays counts


def _timeline(llm, ids) -> list[tuple[int, int, float, float]]:
    """(shard, chunk, start ms, end ms) of every shard body of one prefill, from the runner's events."""
    from ninfer_numba.kernels.numba_env import cuda
    r = llm.runner
    r.reset()
    r.trace = []
    r.prefill(ids)
    r._sync()
    base = r.trace[0][2]
    rows = [(k, c, cuda.event_elapsed_time(base, a), cuda.event_elapsed_time(base, b)) for k, c, a, b in r.trace]
    r.trace = None
    return rows


def _overlap(rows) -> float:
    """ms during which two or more shard bodies ran at once."""
    edges = sorted([(a, 1) for _, _, a, _ in rows] + [(b, -1) for _, _, _, b in rows])
    depth, last, total = 0, 0.0, 0.0
    for t, d in edges:
        if depth >= 2:
            total += t - last
        depth += d
        last = t
    return total


def handoff_gbps(n_floats: int, seconds: float) -> float:
    """GB/s of one hand-off of n_floats float32: the payload crosses the host link twice (out, then back in)."""
    return 2 * 4 * n_floats / seconds / 1e9


def _time_handoff(n_floats: int) -> float:
    """Median seconds of one hand-off of n_floats float32 on the current GPU: device -> portable pinned host
    buffer -> device on one stream, as sharded_runner's _shard_body copies (there on two streams ordered by
    events). The copies are replayed from a CUDA graph, as a decode step's are, so numba's host time per
    copy call is not what is timed (benchmarks/timing.py); the data must arrive unchanged."""
    import numpy as np

    from benchmarks.timing import time_graph
    from ninfer_numba.engine.sharded_runner import _portable_pinned
    from ninfer_numba.kernels.numba_env import cuda
    want = np.arange(n_floats, dtype=np.float32)
    src, dst, bridge = cuda.to_device(want), cuda.device_array(n_floats, np.float32), _portable_pinned(n_floats)

    def handoff(stream):
        src.copy_to_host(bridge, stream=stream)
        dst.copy_to_device(bridge, stream=stream)
    timing = time_graph(handoff, n_inner=HANDOFFS_PER_REPLAY, reps=REPLAYS)
    if not np.array_equal(dst.copy_to_host(), want):
        raise RuntimeError(f"a hand-off of {n_floats} floats did not arrive unchanged")
    return timing.median_ms / 1e3


def _print_handoffs(n_embd: int, chunk: int, shards: int, bridge_s: tuple[float, float], prompt: int) -> None:
    """The hand-off of one decode row and of one prefill chunk, each beside the split's measured extra time
    (bridge_s: prefill seconds, decode seconds per token): a token crosses shards - 1 boundaries, a prefill
    of ``prompt`` tokens ceil(prompt / chunk) times as many, whose copies may overlap other shards' work."""
    print(f"bridge hand-off on GPU 0 (device -> portable pinned host -> device; CUDA events, median of {REPLAYS} "
          f"graph replays of {HANDOFFS_PER_REPLAY}; GB/s counts both copies):")
    n_chunks = -(-prompt // chunk)
    for label, rows, count, extra, per in (("decode row", 1, shards - 1, bridge_s[1], "token"),
                                           ("prefill chunk", chunk, n_chunks * (shards - 1), bridge_s[0],
                                            f"{prompt}-token prefill")):
        n = rows * n_embd
        t = _time_handoff(n)
        print(f"  {label:13s} [{rows}, {n_embd}] f32 {4 * n / 1e6:8.3f} MB {t * 1e6:9.1f} us "
              f"{handoff_gbps(n, t):6.1f} GB/s; {count} per {per}: {count * t * 1e6:.1f} us of the "
              f"{extra * 1e6:+.1f} us bridge", flush=True)


def _check_equal(model: str, counts: list[int]) -> bool:
    """The split into each of counts shards against the plain runner: logits of every prompt position bit for
    bit and 16 greedy tokens; prints one line per count."""
    import numpy as np

    from ninfer_numba import LLM, SamplingParams
    prompt = np.random.default_rng(1).integers(0, 1000, 200).tolist()
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(gpus):
        llm = LLM(model, backend="cuda", max_seq=256, prefill_chunk=64, prefix_cache_mb=0, gpus=gpus)
        out = llm.logits(prompt), llm.generate(prompt, greedy).token_ids
        del llm
        return out
    want_logits, want_tokens = run("")
    ok = True
    for n in counts:
        logits, tokens = run(",".join(["0"] * n))
        same = bool(np.array_equal(logits, want_logits))
        diff = float(np.max(np.abs(logits - want_logits)))
        print(f"{n} shards against the plain runner: logits of {len(prompt)} positions bit for bit {same} "
              f"(max |diff| {diff:.3g}); 16 greedy tokens equal {tokens == want_tokens}", flush=True)
        ok = ok and same and tokens == want_tokens
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--check", default="2,4", help="shard counts to check against the plain runner, or none")
    a = ap.parse_args(argv)
    equal = a.check == "none" or _check_equal(a.model, [int(n) for n in a.check.split(",")])
    import numpy as np

    from ninfer_numba import LLM
    max_seq = a.prompt + a.gen + 8
    ids = np.random.default_rng(0).integers(0, 1000, a.prompt).tolist()
    results, n_embd = {}, None
    split_gpus = ",".join(["0"] * a.shards)
    for label, gpus in (("plain cuda runner", ""), ("1 shard", "0,"), (f"{a.shards} shards", split_gpus)):
        llm = LLM(a.model, backend="cuda", max_seq=max_seq, prefill_chunk=a.prefill_chunk, prefix_cache_mb=0,
                  gpus=gpus)
        pre = statistics.median(llm.bench_prefill(a.prompt) for _ in range(3))
        dec = statistics.median(llm.bench_decode(a.gen) for _ in range(3)) / a.gen
        results[label], n_embd = (pre, dec), llm.config.n_embd
        print(f"{label:18s} prefill {a.prompt} tokens {pre * 1e3:9.1f} ms   decode {dec * 1e3:7.3f} ms/token"
              f"   (compile {llm.compile_seconds:.1f} s)", flush=True)
        if gpus and gpus != "0,":
            rows = _timeline(llm, ids)
            for k in range(a.shards):
                busy = sum(b - s for kk, _, s, b in rows if kk == k)
                print(f"  shard {k}: busy {busy:8.1f} ms over {sum(kk == k for kk, *_ in rows)} chunks")
            span = max(b for *_, b in rows) - min(s for _, _, s, _ in rows)
            print(f"  traced prefill {span:.1f} ms; two shards running at once for {_overlap(rows):.1f} ms")
        del llm
    one, split = results["1 shard"], results[f"{a.shards} shards"]
    print(f"bridge ({a.shards} shards - 1 shard): prefill {(split[0] - one[0]) * 1e3:+.1f} ms per {a.prompt} tokens, "
          f"decode {(split[1] - one[1]) * 1e6:+.1f} us per token")
    _print_handoffs(n_embd, min(a.prefill_chunk, a.prompt), a.shards, (split[0] - one[0], split[1] - one[1]),
                    a.prompt)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
