"""Concurrent streams through the server, beside llama.cpp's llama-batched-bench on the same file.

    python -m benchmarks.e2e.concurrency --model M.gguf [--backend cuda] [--streams 1,2,4,8,16,32]
        [--batch-slots 16] [--no-pack-prompts] [--prompt-tokens 128] [--max-tokens 128]
        [--llama-batched-bench PATH | --no-llamacpp]
        [--out r.json]   (and r.png beside it: aggregate and per-stream t/s against the streams, both engines)

Ours: `ninfer serve --batch-slots B` in a subprocess (server_stream.py's deployment shape; B greedy streams
decoded together, the rest wait for a slot); after a warm-up request and a warm-up burst of min(max N,
B) short ones (first shapes of the batched step and of packed prefills), for each N, N clients send a
streamed chat completion at once (a prompt of about --prompt-tokens tokens each, its own text, greedy,
ignore_eos so each generates exactly --max-tokens; every client's HTTP client is made before any request is
sent, and the spread of the send times is reported). Per stream as its client sees it: decode t/s ((tokens
- 1) / (last delta - first delta)), the median and the slowest; aggregate: all generated tokens / the batch's
wall time (first request sent to last stream done, prefills included) and decode aggregate (tokens after
each stream's first / from the earliest first token to the last token).
llama.cpp: llama-batched-bench -npp P -ntg M -npl 1,2,... (prompts not shared, full GPU offload, flash
attention), its S_TG (B·TG / generation time) as the aggregate and S_TG / B per stream. The binary comes
from the llama-bench build (`python -m benchmarks.llamacpp build` builds both).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.e2e.server_stream import WORDS, chat_deltas, running_server


def stream_chat(url: str, model: str, text: str, max_tokens: int, ready: threading.Barrier | None = None) -> dict:
    """One streamed chat completion of exactly max_tokens tokens; client-side time stamps. With ``ready``, the
    request goes out once every client of the batch is made: an httpx client takes ~10-30 ms of the GIL to
    make (its TLS context), so 16 threads making theirs as they start sent their requests over ~0.1-0.3 s, and
    the batch's wall time counted that setup."""
    import httpx
    body = dict(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                temperature=0.0, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    with httpx.Client(base_url=url, timeout=3600) as http:
        if ready is not None:
            ready.wait(timeout=120)
        t0 = time.perf_counter()
        deltas, usage = chat_deltas(http, body)
    stamps = [t for t, d in deltas if d.get("content") or d.get("reasoning_content")]
    return {"start": t0, "first": stamps[0] if stamps else float("nan"), "last": stamps[-1] if stamps else t0,
            "end": time.perf_counter(), "tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "timings": usage.get("timings")}


def run_batch(url: str, model: str, texts: list[str], max_tokens: int) -> dict:
    """len(texts) streams at once (every client made, then every request sent): per-stream decode t/s, the
    batch's aggregates, and the spread of the requests' send times."""
    results: list[dict | BaseException] = [None] * len(texts)
    ready = threading.Barrier(len(texts))

    def one(i: int) -> None:
        try:
            results[i] = stream_chat(url, model, texts[i], max_tokens, ready)
        except BaseException as e:                      # noqa: BLE001 (reported below, not swallowed)
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(texts)} streams failed: {errors[0]!r}")
    per = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in results if r["tokens"] > 1 and r["last"] > r["first"]]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    decode_span = max(r["last"] for r in results) - min(r["first"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"streams": len(texts), "tokens": tokens, "prompt_tokens": [r["prompt_tokens"] for r in results],
            "per_stream_tps": per, "median_stream_tps": statistics.median(per) if per else float("nan"),
            "aggregate_tps": tokens / wall,
            "decode_aggregate_tps": (tokens - len(results)) / decode_span if decode_span > 0 else float("nan"),
            "slowest_stream_tps": min(per) if per else float("nan"),
            "wall_s": wall, "send_spread_s": max(r["start"] for r in results) - min(r["start"] for r in results),
            "server_ms": phases([r["timings"] for r in results if r["timings"]])}


def phases(timings: list[dict]) -> dict:
    """The server's phases of a batch's requests (worker.JobOutput.timings, ms): median and max of each."""
    keys = ("prepare_ms", "queue_ms", "prefill_ms", "first_token_ms")
    return {k: {"median": statistics.median(t[k] for t in timings), "max": max(t[k] for t in timings)}
            for k in keys} if timings else {}


def ours(a, log) -> list[dict]:
    url = f"http://127.0.0.1:{a.port}"
    streams = [int(x) for x in a.streams.split(",")]
    cmd = [sys.executable, "-m", "ninfer_numba", "serve", "--model", a.model, "--backend", a.backend, "--port",
           str(a.port), "--max-seq", str(a.prompt_tokens + a.max_tokens + 256), "--max-queue", str(max(streams) + 8),
           "--batch-slots", str(a.batch_slots)] + (["--no-pack-prompts"] if a.no_pack_prompts else [])
    with running_server(cmd, url, a.startup_timeout, log):
        import httpx
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        rng = np.random.default_rng(0)
        words = max(1, round(a.prompt_tokens * 0.75))          # about a token per word and a bit
        text = lambda: " ".join(rng.choice(WORDS, words))      # noqa: E731
        run_batch(url, model, [text()], 4)                     # warm-up: compile, capture, first request
        burst = min(max(streams), a.batch_slots)
        if burst > 1:       # and a burst: the batched step's and a packed prefill's first shapes (kernels, plans)
            run_batch(url, model, [text() for _ in range(burst)], 4)
        rows = []
        for n in streams:
            row = run_batch(url, model, [text() for _ in range(n)], a.max_tokens)
            log(f"ours, {n} streams: aggregate {row['aggregate_tps']:.1f} t/s (decode "
                f"{row['decode_aggregate_tps']:.1f}), median stream {row['median_stream_tps']:.1f} t/s, slowest "
                f"{row['slowest_stream_tps']:.1f}; requests sent within {row['send_spread_s'] * 1e3:.1f} ms")
            if row["server_ms"]:
                log("  server ms (median / max): " + ", ".join(
                    f"{k[:-3]} {v['median']:.1f} / {v['max']:.1f}" for k, v in row["server_ms"].items()))
            rows.append(row)
        return rows


def llama_batched(binary: Path, a, log) -> list[dict]:
    """llama-batched-bench's rows (JSONL), one per number of parallel sequences."""
    streams = [int(x) for x in a.streams.split(",")]
    ctx = max(streams) * (a.prompt_tokens + a.max_tokens) + 64
    cmd = [str(binary), "-m", a.model, "-c", str(ctx), "-b", "2048", "-ub", "512", "-ngl", "99", "-fa", "on",
           "-npp", str(a.prompt_tokens), "-ntg", str(a.max_tokens), "-npl", a.streams, "--output-format", "jsonl"]
    log("running: " + " ".join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.llama_timeout)
    if out.returncode != 0:
        raise RuntimeError(f"llama-batched-bench exited {out.returncode}: {out.stderr[-400:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [{"streams": r["pl"], "aggregate_tps": r["speed_tg"], "per_stream_tps": r["speed_tg"] / r["pl"],
             "prompt_tps": r["speed_pp"], "raw": r} for r in rows]


def find_batched_bench(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    from benchmarks.llamacpp import find_llama_bench
    bench = find_llama_bench()
    candidate = bench.parent / "llama-batched-bench" if bench else None
    return candidate if candidate is not None and candidate.is_file() else None


def table(ours_rows: list[dict], llama_rows: list[dict]) -> str:
    """Markdown: each stream count's aggregates (and x the one-stream row of the same engine and measure), the
    median stream and the slowest against one stream alone (issue 17's gates: decode aggregate >= 6x,
    slowest >= 0.35x at 16 streams)."""
    by_n = {r["streams"]: r for r in llama_rows}
    one = next((r for r in ours_rows if r["streams"] == 1), None)
    l_one = by_n.get(1)
    x = lambda v, base: f"{v:.1f} ({v / base:.2f}x)" if base else f"{v:.1f}"     # noqa: E731
    lines = ["| streams | ours aggregate t/s | ours decode aggregate t/s | ours median stream t/s | slowest / alone | "
             "llama.cpp S_TG t/s | llama.cpp per stream t/s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ours_rows:
        ll = by_n.get(r["streams"])
        lines.append(
            f"| {r['streams']} | {x(r['aggregate_tps'], one and one['aggregate_tps'])} | "
            f"{x(r['decode_aggregate_tps'], one and one['decode_aggregate_tps'])} | {r['median_stream_tps']:.1f} | "
            f"{r['slowest_stream_tps'] / one['median_stream_tps'] if one else float('nan'):.2f} | "
            f"{x(ll['aggregate_tps'], l_one and l_one['aggregate_tps']) if ll else 'nan'} | "
            f"{ll['per_stream_tps'] if ll else float('nan'):.1f} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path:
    """Aggregate and per-stream t/s against the number of streams, ours beside llama.cpp's, into path (png)."""
    from benchmarks.plot import ENGINE_STYLE, plt, save_figure     # plt there: the files-only backend
    fig, (agg, per) = plt.subplots(1, 2, figsize=(11, 4.2))
    ours, theirs = report["ours"], report["llamacpp"]
    n = [r["streams"] for r in ours]
    agg.plot(n, [r["aggregate_tps"] for r in ours], label="ninfer (wall, prefills included)",
             **ENGINE_STYLE["ninfer"])
    agg.plot(n, [r["decode_aggregate_tps"] for r in ours], label="ninfer (decode)", linestyle="--",
             **ENGINE_STYLE["ninfer"])
    per.plot(n, [r["median_stream_tps"] for r in ours], label="ninfer (median stream)", **ENGINE_STYLE["ninfer"])
    per.plot(n, [r["slowest_stream_tps"] for r in ours], label="ninfer (slowest stream)", linestyle="--",
             **ENGINE_STYLE["ninfer"])
    if theirs:
        m = [r["streams"] for r in theirs]
        agg.plot(m, [r["aggregate_tps"] for r in theirs], label="llama.cpp S_TG", **ENGINE_STYLE["llama.cpp"])
        per.plot(m, [r["per_stream_tps"] for r in theirs], label="llama.cpp S_TG / streams",
                 **ENGINE_STYLE["llama.cpp"])
    for ax, what in ((agg, "aggregate t/s"), (per, "t/s per stream")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(v) for v in n])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(report['model']).name}: {report['prompt_tokens']}-token prompts, {report['max_tokens']} "
                 f"tokens each, --batch-slots {report['batch_slots']}")
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--streams", default="1,2,4,8,16,32")
    ap.add_argument("--batch-slots", type=int, default=16, help="the server's --batch-slots")
    ap.add_argument("--no-pack-prompts", action="store_true", help="the server's --no-pack-prompts")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--llama-batched-bench", default=None, help="the binary (default: beside the cached llama-bench)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--llama-timeout", type=float, default=600)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)      # noqa: E731
    report = {"model": a.model, "backend": a.backend, "batch_slots": a.batch_slots,
              "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens, "ours": ours(a, log), "llamacpp": []}
    if not a.no_llamacpp:
        binary = find_batched_bench(a.llama_batched_bench)
        if binary is None:
            log("llama-batched-bench not found (python -m benchmarks.llamacpp build makes it): llama.cpp skipped")
        else:
            report["llamacpp"] = llama_batched(binary, a, log)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
        log(f"plot: {plot(report, Path(a.out).with_suffix('.png'))}")
    print(table(report["ours"], report["llamacpp"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
