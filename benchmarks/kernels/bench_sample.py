"""Microbenchmark of token selection and the embedding gather, timed inside replayed CUDA graphs.

    python -m benchmarks.kernels.bench_sample [--vocab 248320] [--out FILE]

Sampling is latency-bound (1 MB of logits, produced by the previous kernel and resident in L2 during decode),
so its rows report µs against the targets (argmax < 10 µs, sample < 30 µs); the step counter in the
parameter buffer advances on every replay, so each replay draws a new u. The embedding rows report GB/s
(int8 + f16 scales read, f32 written) against the 4.25 TB/s copy rate; token ids are random rows of a
≥ 1 GB table, so reads come from HBM. With --out, one JSON object per row is appended.
"""
from __future__ import annotations

import argparse

import numpy as np

from ninfer_numba.kernels.embed import embed_gather_q8
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.sample.device import SampleWorkspace, argmax, pack_sample_params, sample
from benchmarks.timing import append_jsonl, time_graph

COPY_GBS = 4250.0
SAMPLE_CFGS = {
    "greedy+penalties": dict(temperature=0.0, repetition=1.1),
    "T1 (full vocab)": dict(temperature=1.0),
    "T0.6 k20 p0.95": dict(temperature=0.6, top_k=20, top_p=0.95),
    "T1 p0.9 minp0.05": dict(temperature=1.0, top_p=0.9, min_p=0.05),
    "T1 k100000 p0.8 ties": dict(temperature=1.0, top_k=100000, top_p=0.8),
}


def bench_sampling(V, rng):
    rows = []
    peaked = rng.standard_normal(V).astype(np.float32)
    peaked[rng.choice(V, 8, replace=False)] += 12.0
    ties = rng.integers(-3, 3, V).astype(np.float32)
    ws, out = SampleWorkspace(V), cuda.to_device(np.zeros(1, np.int32))
    d_logits, d_ties = cuda.to_device(peaked), cuda.to_device(ties)
    counts = np.zeros(V, np.int32)
    counts[rng.choice(V, 64, replace=False)] = 1
    d_counts = cuda.to_device(counts)
    t = time_graph(lambda s: argmax(d_logits, out, ws, stream=s), n_inner=50, reps=20)
    rows.append(dict(kernel="argmax", shape=f"V{V}", us=t.median_ms * 1e3, target_us=10.0))
    for name, cfg in SAMPLE_CFGS.items():
        params = cuda.to_device(pack_sample_params(**cfg, seed=1))
        logits = d_ties if "ties" in name else d_logits
        t = time_graph(lambda s: sample(logits, d_counts, params, out, ws, stream=s), n_inner=20, reps=20)
        rows.append(dict(kernel=f"sample {name}", shape=f"V{V}", us=t.median_ms * 1e3, target_us=30.0))
    return rows


def bench_embed(V, rng):
    rows = []
    for D in (4096, 5120):
        wq = cuda.to_device(rng.integers(-128, 128, (V, D), dtype=np.int8))
        ws = cuda.to_device((rng.standard_normal((V, D // 32)) * 0.02).astype(np.float16))
        for T in (1, 2048):
            toks = cuda.to_device(rng.integers(0, V, T).astype(np.int32))
            out = cuda.device_array((T, D), np.float32)
            t = time_graph(lambda s: embed_gather_q8(wq, ws, toks, out, stream=s), n_inner=50, reps=20)
            nbytes = T * D * (1 + 2 / 32 + 4)
            gbs = nbytes / (t.median_ms * 1e-3) / 1e9
            rows.append(dict(kernel="embed_gather_q8", shape=f"T{T}-D{D}", us=t.median_ms * 1e3, gbs=gbs,
                             pct=100 * gbs / COPY_GBS))
        del wq, ws
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--out", default=None, help="append JSON lines here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = bench_sampling(args.vocab, rng) + bench_embed(args.vocab, rng)
    print(f"{'kernel':34s} {'shape':14s} {'µs':>8s} {'GB/s':>8s} {'% / target':>11s}")
    for r in rows:
        tail = f"{r['gbs']:8.0f} {r['pct']:10.1f}%" if "gbs" in r else f"{'':8s} {r['target_us']:9.0f}µs"
        print(f"{r['kernel']:34s} {r['shape']:14s} {r['us']:8.2f} {tail}")
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
