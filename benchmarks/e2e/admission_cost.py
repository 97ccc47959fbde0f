"""What admitting a prompt into a batched-decode slot costs on the GPU: its prefill, a snapshot, a restore.

    python -m benchmarks.e2e.admission_cost --model M.gguf [--lengths 128,131,128,140,128,129,137,128] [--warm]

Each prompt (random ids of the given length) is prefilled into its own slot of ``LLM.scheduler(16)``'s
decoder, then snapshotted and restored into another slot; wall milliseconds of each with the stream
synchronized. A length seen before may replay captured prefill graphs (engine/cuda_runner.py), so repeated
lengths show the steady cost and new ones the first. The server's shutdown line (``ninfer serve: batched
decode: ... prefills in ...``) gives the same cost in service.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="128,131,128,140,128,129,137,128")
    ap.add_argument("--warm", action="store_true", help="capture the prefill pieces first, as a server does")
    a = ap.parse_args(argv)
    from ninfer_numba import LLM
    lengths = [int(x) for x in a.lengths.split(",")]
    if len(lengths) > 8:
        raise SystemExit("at most 8 lengths (two slots each of 16)")
    llm = LLM(a.model, backend="cuda", max_seq=max(lengths) + 64)
    dec = llm.scheduler(16).decoder
    if a.warm and hasattr(dec, "warm"):                 # what a server does at start (server/worker.py)
        print(f"prefill pieces captured in {dec.warm():.2f} s")
    rng = np.random.default_rng(0)
    print(f"{'slot':>4} {'tokens':>6} {'prefill ms':>10} {'snapshot ms':>11} {'restore ms':>10} {'MB':>7}")
    for s, n in enumerate(lengths):
        ids = rng.integers(0, llm.config.n_vocab, n).tolist()
        t0 = time.perf_counter()
        dec.prefill(s, ids)
        dec.stream.synchronize()
        t1 = time.perf_counter()
        snap = dec.snapshot(s)
        dec.stream.synchronize()
        t2 = time.perf_counter()
        dec.restore(s + 8, snap)
        dec.stream.synchronize()
        t3 = time.perf_counter()
        print(f"{s:>4} {n:>6} {(t1 - t0) * 1e3:>10.1f} {(t2 - t1) * 1e3:>11.2f} {(t3 - t2) * 1e3:>10.2f} "
              f"{snap.nbytes / 1e6:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
