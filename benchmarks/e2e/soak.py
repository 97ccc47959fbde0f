"""A soak of the server: many requests from concurrent clients, some leaving mid-stream; no 5xx, memory flat.

    python -m benchmarks.e2e.soak [--model M.gguf] [--backend cpu] [--requests 1000] [--clients 8]
        [--batch-slots 4] [--max-queue 4] [--prefix-cache-mb 1] [--max-growth-mb 24] [--out r.json]

Starts `ninfer serve` in a subprocess (default: the tiny synthetic model with the real vocabulary, written to
a temporary folder; CPU backend), with a short line (--max-queue) so that some requests get 429, and a small
prefix cache so that snapshots are evicted as well as hit. --clients threads, each with its own HTTP client,
send --requests requests between them, each drawn (seeded) from a mix: streamed chats read to the end,
streamed chats whose client closes the connection after a few chunks, non-streaming chats (some of them
abandoned by a client timeout), chats sharing a long system prompt (prefix-cache hits), sampled chats (the
worker runs those alone, between batched steps) and plain completions. A 429 must carry Retry-After; any
5xx, other status or transport error the client did not cause is a failure; after a 429 a client waits
--backoff seconds (less than Retry-After, to keep the line full) before its next request.

Memory: the server's resident set (VmRSS in /proc/<pid>/status, Linux) after every --sample-every requests.
Flat means that after the warm-up (the first --warmup of the requests: compiled paths, the prefix cache
filled to its budget, the allocator's arenas) the median of the last third of the samples is at most
--max-growth-mb above the median of the first third. Exit 0 when there was no failure and memory stayed
flat, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.e2e.server_stream import WORDS, running_server

KINDS = ("stream", "leave", "plain", "abandon", "shared", "sampled", "completion")
WEIGHTS = (0.30, 0.20, 0.12, 0.05, 0.15, 0.10, 0.08)
SYSTEM = " ".join(WORDS * 6)             # a long system prompt the "shared" requests have in common


def request_of(kind: str, rng: np.random.Generator, model: str, max_tokens: int) -> tuple[str, dict]:
    """(path, JSON body) of one request of this kind for the served model, its text and length drawn from rng."""
    text = " ".join(rng.choice(WORDS, int(rng.integers(3, 40))))
    n = int(rng.integers(1, max_tokens + 1))
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": n, "temperature": 0.0}
    messages = [{"role": "user", "content": text}]
    if kind == "shared":
        messages.insert(0, {"role": "system", "content": SYSTEM})
    body = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0.0,
            "stream": kind in ("stream", "leave", "shared")}
    if kind == "sampled":
        body.update(temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 30)))
    return "/v1/chat/completions", body


def send(http, kind: str, path: str, body: dict, leave_after: int) -> str:
    """One request; its outcome: the status code as text, "left" (the client closed the connection on
    purpose) or "error: ..." (a transport failure the client did not cause)."""
    import httpx
    try:
        if kind == "abandon":            # a client that gives up waiting: the server sees the socket close
            try:
                return str(http.post(path, json=body, timeout=0.05).status_code)
            except httpx.TimeoutException:
                return "left"
        if not body.get("stream"):
            r = http.post(path, json=body)
            return check_429(r) if r.status_code == 429 else str(r.status_code)
        with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return check_429(r) if r.status_code == 429 else str(r.status_code)
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if kind == "leave" and chunks >= leave_after:
                    return "left"                         # leaving the block closes the connection
            return "200"
    except httpx.HTTPError as e:
        return f"error: {type(e).__name__}: {e}"


def check_429(r) -> str:
    return "429" if r.headers.get("retry-after") else "429 without Retry-After"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def memory_growth(samples: list[tuple[int, float]], warmup: int) -> tuple[float, float, float]:
    """(growth, base, end) in MB: the median of the last third of the samples taken after `warmup` requests
    less the median of the first third (a resident set swings by tens of MB as the allocator takes and
    returns arenas; a leak moves the medians)."""
    after = [mb for n, mb in samples if n > warmup]
    if len(after) < 3:
        raise SystemExit(f"{len(after)} memory samples after the warm-up: take more requests or sample more often")
    third = len(after) // 3
    base, end = float(np.median(after[:third])), float(np.median(after[-third:]))
    return end - base, base, end


def soak(url: str, pid: int, a, log) -> dict:
    """a.requests requests from a.clients threads; outcomes counted and the server's memory sampled."""
    import httpx
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng = np.random.default_rng(a.seed)
    plan = [(k, int(rng.integers(1, 4))) for k in rng.choice(KINDS, a.requests, p=WEIGHTS)]
    seeds = rng.integers(1 << 30, size=a.requests)
    lock, outcomes, by_kind, samples = threading.Lock(), Counter(), Counter(), []
    failures: list[str] = []
    done = [0]
    nxt = iter(range(a.requests))
    t0 = time.perf_counter()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                kind, leave_after = plan[i]
                path, body = request_of(kind, np.random.default_rng(seeds[i]), model, a.max_tokens)
                outcome = send(http, kind, path, body, leave_after)
                if outcome == "429":                      # told to come back later: a while, then the next one
                    time.sleep(a.backoff)
                with lock:
                    outcomes[outcome] += 1
                    by_kind[f"{kind} {outcome}"] += 1
                    if outcome not in ("200", "429", "left"):
                        failures.append(f"request {i} ({kind}): {outcome}")
                    done[0] += 1
                    if done[0] % a.sample_every == 0:
                        samples.append((done[0], round(rss_mb(pid), 1)))
                        if done[0] % (a.sample_every * 5) == 0:
                            log(f"soak: {done[0]}/{a.requests} requests, server {samples[-1][1]:.1f} MB, "
                                f"{dict(outcomes)}")

    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = httpx.get(url + "/health", timeout=10).status_code       # still serving once it is over
    growth, base, end = memory_growth(samples, int(a.requests * a.warmup))
    flat = bool(growth <= a.max_growth_mb)
    return {"requests": a.requests, "clients": a.clients, "wall_s": round(wall, 2),
            "outcomes": dict(outcomes), "by_kind": dict(sorted(by_kind.items())), "failures": failures,
            "health_after": after, "rss_mb": samples, "rss_base_mb": base, "rss_end_mb": end,
            "rss_growth_mb": round(growth, 1),
            "flat": flat, "ok": not failures and after == 200 and flat}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file with a vocabulary (default: the tiny synthetic one)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--batch-slots", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--prefix-cache-mb", type=int, default=1)
    ap.add_argument("--backoff", type=float, default=0.25, help="seconds a client waits after a 429")
    ap.add_argument("--max-tokens", type=int, default=12, help="each request's max_tokens is drawn from 1..this")
    ap.add_argument("--sample-every", type=int, default=20, help="requests between memory samples")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of the requests before the memory baseline")
    ap.add_argument("--max-growth-mb", type=float, default=24.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8767)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.requests < 1 or a.clients < 1 or a.sample_every < 1:
        raise SystemExit("--requests, --clients and --sample-every must be at least 1")
    log = lambda m: print(m, file=sys.stderr, flush=True)      # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from ninfer_numba.synth import write_synthetic_gguf
            model = str(write_synthetic_gguf(Path(tmp) / "tiny.gguf", "tiny", seed=0))
        url = f"http://127.0.0.1:{a.port}"
        cmd = [sys.executable, "-m", "ninfer_numba", "serve", "--model", model, "--backend", a.backend,
               "--port", str(a.port), "--max-seq", "1024", "--max-queue", str(a.max_queue),
               "--batch-slots", str(a.batch_slots), "--prefix-cache-mb", str(a.prefix_cache_mb)]
        with running_server(cmd, url, a.startup_timeout, log) as proc:
            report = soak(url, proc.pid, a, log)
    report.update(model=a.model or "tiny (synthetic)", backend=a.backend, batch_slots=a.batch_slots,
                  max_queue=a.max_queue)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"soak: {report['requests']} requests from {report['clients']} clients in {report['wall_s']:.1f} s: "
          f"{report['outcomes']}; {len(report['failures'])} failures; server memory (medians) {report['rss_base_mb']:.1f}"
          f" MB after the warm-up, {report['rss_end_mb']:.1f} at the end "
          f"(growth {report['rss_growth_mb']:+.1f} MB, limit {a.max_growth_mb:.0f}): "
          f"{'flat' if report['flat'] else 'NOT flat'}")
    for f in report["failures"][:10]:
        print("  " + f)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
