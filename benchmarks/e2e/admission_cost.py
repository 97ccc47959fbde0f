"""What admitting a prompt into a batched-decode slot costs on the GPU: its prefill, a snapshot, a restore.

    python -m benchmarks.e2e.admission_cost --model M.gguf [--lengths 128,131,128,140,128,129,137,128] [--warm]
        [--packs 3,9,15] [--profile 25]

Each prompt (random ids of the given length) is prefilled into its own slot of ``LLM.scheduler(16)``'s
decoder, then snapshotted and restored into another slot; wall milliseconds of each with the stream
synchronized. A length seen before may replay captured prefill graphs (engine/cuda_runner.py), so repeated
lengths show the steady cost and new ones the first. The server's shutdown line (``ninfer serve: batched
decode: ... prefills in ...``) gives the same cost in service.

Then --packs: for each count k, k prompts (the lengths in turn) prefilled together by the decoder's
prefill_many (one packed forward, as the scheduler admits three or more waiting prompts), twice: wall ms
with the stream synchronized, the first time and again (kernels and plans first met, then the steady cost),
beside k single prefills' sum from the table above, and how the second splits: the host's enqueueing of the
forward, then the picks and the wait for the GPU (BatchedDecoder.last_pack_seconds). --profile N: the last
pack's second forward under cProfile, its N costliest functions by own time (where a launch-bound forward's
host time goes).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="128,131,128,140,128,129,137,128")
    ap.add_argument("--warm", action="store_true", help="capture the prefill pieces first, as a server does")
    ap.add_argument("--packs", default="3,9,15", help="prompts per packed prefill to time ('' for none)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N costliest functions of the last pack's second forward (cProfile)")
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
    singles = []                                        # each prefill's ms, in the order of lengths
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
        singles.append((t1 - t0) * 1e3)
    packs = [int(x) for x in a.packs.split(",") if x]
    if packs and not hasattr(dec, "prefill_many"):
        raise SystemExit("this decoder has no prefill_many")
    if packs:
        print(f"{'prompts':>7} {'tokens':>6} {'packed ms, first':>16} {'again':>7} {'enqueue':>7} {'wait':>6} "
              f"{'singles ms':>10}")
    profile = None
    for k in packs:
        if not 1 <= k <= dec.n_slots:
            raise SystemExit(f"a pack of {k}: at most {dec.n_slots} prompts (one per slot)")
        ns = [lengths[j % len(lengths)] for j in range(k)]
        items = [(j, rng.integers(0, llm.config.n_vocab, n).tolist()) for j, n in enumerate(ns)]
        ms = []
        for again in range(2):
            for j, _ids in items:
                dec.reset(j)
            dec.stream.synchronize()
            if again and a.profile and k == packs[-1]:
                profile = cProfile.Profile()
                profile.enable()
            t0 = time.perf_counter()
            dec.prefill_many(items)
            dec.stream.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
        if profile is not None:
            profile.disable()
        enqueue, wait = (x * 1e3 for x in dec.last_pack_seconds)
        single = sum(singles[j % len(singles)] for j in range(k))
        print(f"{k:>7} {sum(ns):>6} {ms[0]:>16.1f} {ms[1]:>7.1f} {enqueue:>7.1f} {wait:>6.1f} {single:>10.1f}")
    if profile is not None:
        print(f"the pack of {packs[-1]}'s second forward (under cProfile, slower than above), by own time:")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
