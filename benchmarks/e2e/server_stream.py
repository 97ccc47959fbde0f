"""Streamed chat completions through the `openai` client against `ninfer serve`, beside the engine's own decode.

    python -m benchmarks.e2e.server_stream --model M.gguf [--backend cuda] [--prompt-tokens 2000]
        [--max-tokens 128] [--runs 3] [--out r.json]

Starts `python -m ninfer_numba serve` in a subprocess (the deployment shape: its own process, uvicorn and
the generation worker), waits for /health, then streams ``runs`` chat completions of about
``prompt-tokens`` prompt tokens each (random words, a fresh prompt every run), greedy and sampled. Per
request, as the client sees it: time to first token (request sent -> first content or reasoning delta) and
decode tokens/s ((completion tokens - 1) / (last token delta - first token delta)). Then the server is
stopped and the same file is loaded in this process to time the engine's own tg128 at the same depth
(llama-bench semantics, LLM.bench_decode) and prefill of the same length. Overhead = 1 - client / engine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np

WORDS = ("river stone cloud lantern orbit maple quiet signal harbor velvet copper meadow thunder pixel "
         "garden silver window marble echo falcon cedar north amber canyon ribbon spark tide willow").split()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server did not become healthy in {timeout:.0f} s")


@contextlib.contextmanager
def running_server(cmd: list[str], url: str, startup_timeout: float, log):
    """`ninfer serve` (cmd) in a subprocess, healthy on entry, stopped on exit (terminate, then kill)."""
    log("starting: " + " ".join(cmd))
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    try:
        t0 = time.perf_counter()
        _wait_healthy(url, proc, startup_timeout)
        log(f"server healthy after {time.perf_counter() - t0:.1f} s")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def chat_deltas(http, body: dict) -> tuple[list[tuple[float, dict]], dict]:
    """A streamed chat completion (body with stream and stream_options.include_usage) through an httpx-style
    client whose base is the server: each choice's delta with its arrival time, and the usage (with the
    server's per-phase "timings" in milliseconds under that key, when it sent them)."""
    deltas, usage = [], None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            usage = event.get("usage") or usage
            if "timings" in event and usage is not None:
                usage = {**usage, "timings": event["timings"]}
            deltas += [(time.perf_counter(), c.get("delta", {})) for c in event.get("choices", [])]
    return deltas, usage


def _text(n_words: int, rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, n_words))


def stream_once(client, model: str, text: str, max_tokens: int, sampling: dict) -> dict:
    """One streamed chat completion; timings as the client sees them."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, **sampling)
    stamps, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta
            if d.content or getattr(d, "reasoning_content", None):
                stamps.append(time.perf_counter())
    n = usage.completion_tokens
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": n, "ttft_s": stamps[0] - t0,
            "decode_tps": (n - 1) / span, "total_s": time.perf_counter() - t0}


def run_server_side(a, log) -> dict:
    port = a.port
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ninfer_numba", "serve", "--model", a.model, "--backend", a.backend,
           "--port", str(port), "--max-seq", str(a.prompt_tokens + a.max_tokens + 512)]
    with running_server(cmd, url, a.startup_timeout, log):
        import openai
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        rng = np.random.default_rng(0)
        probe = stream_once(client, model, _text(400, rng), 2, {"temperature": 0.0})    # warm-up + calibration
        words = max(1, round(400 * a.prompt_tokens / probe["prompt_tokens"]))
        out = {}
        for mode, sampling in (("greedy", {"temperature": 0.0}),
                               ("sampled", {"temperature": 0.7, "top_p": 0.9})):
            runs = []
            for i in range(a.runs):
                extra = {"seed": i} if mode == "sampled" else {}
                r = stream_once(client, model, _text(words, rng), a.max_tokens, {**sampling, **extra})
                log(f"{mode} run {i}: {json.dumps(r)}")
                runs.append(r)
            out[mode] = {"runs": runs,
                         "median_ttft_s": statistics.median(r["ttft_s"] for r in runs),
                         "median_decode_tps": statistics.median(r["decode_tps"] for r in runs),
                         "prompt_tokens": runs[0]["prompt_tokens"]}
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    report = {"model": a.model, "backend": a.backend, "max_tokens": a.max_tokens,
              "server": run_server_side(a, log)}
    depth = report["server"]["greedy"]["prompt_tokens"]
    from ninfer_numba import LLM
    llm = LLM(a.model, backend=a.backend, max_seq=depth + a.max_tokens + 8)
    tg = [a.max_tokens / llm.bench_decode(a.max_tokens, depth=depth, seed=s) for s in range(a.runs)]
    pp = [depth / llm.bench_prefill(depth, seed=s) for s in range(a.runs)]
    report["engine"] = {"depth": depth, f"tg{a.max_tokens}_tps": tg, "median_tg_tps": statistics.median(tg),
                        f"pp{depth}_tps": pp, "median_prefill_s": depth / statistics.median(pp)}
    for mode in ("greedy", "sampled"):
        s = report["server"][mode]
        s["overhead_vs_engine_tg"] = 1 - s["median_decode_tps"] / report["engine"]["median_tg_tps"]
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    summary = {m: (round(report["server"][m]["median_ttft_s"], 3), round(report["server"][m]["median_decode_tps"], 1),
                   f'{100 * report["server"][m]["overhead_vs_engine_tg"]:.1f}%') for m in ("greedy", "sampled")}
    log(f"engine tg{a.max_tokens} @ d{depth}: {report['engine']['median_tg_tps']:.1f} t/s, prefill "
        f"{report['engine']['median_prefill_s']:.3f} s; server (ttft s, client t/s, overhead): {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
