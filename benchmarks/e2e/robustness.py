"""Counts and times for the hardening gates, on the CPU: corrupted GGUF files through the CLI, and malformed
requests through the server while /health is polled.

    python -m benchmarks.e2e.robustness [--skip-fuzz] [--skip-server]

Fuzz: the generator of tests/formats/test_gguf_fuzz.py (seeded, 200+ files from one valid tiny model), each
file through `ninfer info` and `ninfer logits` in child processes under a time limit: outcomes by command
and exit status, how many ended in more than one line of stderr (a traceback), the peak resident memory of
any batch. The test asserts the bounds; this prints the figures.

Server: the scripted engine of tests/server (no model) behind the real app, warmed up as `serve` warms it
(server/api.warm_up); tests/server/test_server_errors.py's malformed chat requests one after another, then a
20 MB body and JSON nested 100,000 deep, while another thread polls /health over a raw socket (one
connection per poll, TCP_NODELAY: the server's time, not an HTTP client's).
"""
from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from pathlib import Path


def fuzz() -> None:
    import numpy as np

    from tests.formats import test_gguf_fuzz as F
    from tests.gguf_factory import QT, TinySpec, tensors_for, write_gguf
    tmp = Path(tempfile.mkdtemp())
    spec = TinySpec(n_layer=4)
    tensors = tensors_for(spec, np.random.default_rng(1))
    base = Path(write_gguf(tmp / "base.gguf", spec, tensors, matrix_type=QT.Q8_0)).read_bytes()
    cases = F._corruptions(base, F._meta_variants(tmp, spec, tensors), np.random.default_rng(F.SEED))
    paths = []
    for data in cases.values():
        p = tmp / "cases" / f"{len(paths):03d}.gguf"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data)
        paths.append(str(p))
    results, peak = [], 0
    for s in range(0, len(paths), F.BATCH):
        batch, batch_peak = F._run_batch(paths[s:s + F.BATCH], str(tmp / "logits.npy"))
        results += batch
        peak = max(peak, batch_peak)
    outcomes: dict[tuple, int] = {}
    for r in results:
        outcomes[(r["cmd"], r["kind"], r["rc"])] = outcomes.get((r["cmd"], r["kind"], r["rc"]), 0) + 1
    multi = sum(r["rc"] not in (0,) and r["stderr_lines"] != 1 for r in results)
    print(f"fuzz: {len(cases)} corrupted files, {len(results)} runs; outcomes (command, end, exit): {outcomes}; "
          f"errors not on one line: {multi}; peak resident {peak / 2**20:.0f} MiB")


def server() -> None:
    import httpx

    from ninfer_numba.formats.qwen_vocab import qwen35_vocab_metadata
    from ninfer_numba.formats.tokenizer import Tokenizer
    from ninfer_numba.server.api import create_app, warm_up
    from tests.server.conftest import LiveServer
    from tests.server.scripted_llm import ScriptedLLM
    from tests.server.test_server_errors import CHAT_CASES
    llm = ScriptedLLM(Tokenizer.from_gguf_kv(qwen35_vocab_metadata()))
    warm_up(llm)
    live = LiveServer(create_app(llm)).start()
    host, port = live.url.split("//")[1].split(":")
    health, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            s = socket.create_connection((host, int(port)))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while s.recv(65536):
                pass
            health.append(time.perf_counter() - t0)
            s.close()
            time.sleep(0.002)
    poller = threading.Thread(target=poll)
    poller.start()
    times, codes, shapes = [], {}, 0
    json_header = {"content-type": "application/json"}
    try:
        with httpx.Client(timeout=10) as c:
            for body, status, _ in CHAT_CASES:
                t0 = time.perf_counter()
                r = (c.post(live.url + "/v1/chat/completions", content=body, headers=json_header)
                     if isinstance(body, bytes) else c.post(live.url + "/v1/chat/completions", json=body))
                times.append(time.perf_counter() - t0)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                shapes += r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
            big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (20 << 20) + b'"}]}'
            extra = []
            for label, body in (("20 MB body", big), ("JSON nested 100,000 deep", b"[" * 100000 + b"]" * 100000)):
                t0 = time.perf_counter()
                r = c.post(live.url + "/v1/chat/completions", content=body, headers=json_header)
                extra.append(f"{label}: {r.status_code} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    finally:
        stop.set()
        poller.join()
        live.stop()
    times.sort()
    health.sort()
    print(f"server: {len(CHAT_CASES)} malformed chat requests, status {codes}, {shapes} with the expected status "
          f"and OpenAI's error shape; median {times[len(times) // 2] * 1e3:.1f} ms, slowest {times[-1] * 1e3:.1f} ms")
    print("server: " + "; ".join(extra))
    print(f"server: /health meanwhile, {len(health)} polls: median {health[len(health) // 2] * 1e3:.2f} ms, "
          f"p99 {health[int(len(health) * 0.99)] * 1e3:.2f} ms, max {health[-1] * 1e3:.2f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-fuzz", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    a = ap.parse_args(argv)
    if not a.skip_fuzz:
        fuzz()
    if not a.skip_server:
        server()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
