"""Logits of each coded KV cache against the float16 cache's, on one model file: the prompt's every position
(prefill path) and each of the greedy decode steps after it (decode path), teacher-forced with the float16
run's tokens so that every type sees the same sequence.

    python -m benchmarks.e2e.kv_logits --model models/q35-9b.gguf [--kv-types k3v3,k4v3,k4v4,q8]
        [--prompt 512] [--gen 64] [--backend cuda] [--seed 0] [--out r.json]

Reported per type: the relative error ||ours - f16|| / ||f16|| over all rows and over the decode rows,
top-1 agreement over all rows, and how many of the greedy tokens the type would itself have picked
(argmax of its logits equal to the float16 run's token). One model load per type (the cache type is fixed
when the engine is made); each is freed before the next.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(llm, prompt: list[int], gen: int, forced: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """(logits [len(prompt) + gen - 1, V]: the prompt's positions, then the decode steps but the last; the
    greedy tokens, or ``forced`` fed instead of this run's own picks)."""
    rows = [llm.logits(prompt)]
    llm.runner.reset()
    last = llm.runner.prefill(prompt)
    toks = []
    for i in range(gen):
        toks.append(int(np.argmax(last)) if forced is None else forced[i])
        if i + 1 < gen:
            last = llm.runner.decode(toks[-1])
            rows.append(last[None])
    return np.concatenate(rows), toks


def compare(ours: np.ndarray, base: np.ndarray, n_prompt: int) -> dict:
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))     # noqa: E731
    return {"rel_error": rel(ours, base), "rel_error_decode": rel(ours[n_prompt:], base[n_prompt:]),
            "top1_agreement": float(np.mean(ours.argmax(-1) == base.argmax(-1))),
            "greedy_same": int(np.sum(ours[n_prompt - 1:].argmax(-1) == base[n_prompt - 1:].argmax(-1)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-types", default="k3v3,k4v3,k4v4,q8")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from ninfer_numba import LLM
    from ninfer_numba.config import KV_CACHE_TYPES
    kv_types = [t for t in a.kv_types.split(",") if t]
    bad = [t for t in kv_types if t not in KV_CACHE_TYPES or t == "f16"]
    if bad or a.prompt < 1 or a.gen < 1:
        raise SystemExit(f"--kv-types from {', '.join(KV_CACHE_TYPES[1:])} (got {bad}); --prompt, --gen >= 1")
    max_seq = a.prompt + a.gen

    def load(kv_type: str):
        t0 = time.perf_counter()
        llm = LLM(a.model, backend=a.backend, max_seq=max_seq, kv_type=kv_type)
        log(f"loaded {a.model} with kv {kv_type} in {time.perf_counter() - t0:.1f} s")
        return llm
    llm = load("f16")
    prompt = np.random.default_rng(a.seed).integers(0, llm.config.n_vocab, a.prompt).tolist()
    base, toks = run(llm, prompt, a.gen)
    del llm
    gc.collect()
    report = {"model": a.model, "backend": a.backend, "prompt": a.prompt, "gen": a.gen, "types": {}}
    for kv in kv_types:
        llm = load(kv)
        ours, _ = run(llm, prompt, a.gen, forced=toks)
        del llm
        gc.collect()
        fig = compare(ours, base, a.prompt)
        report["types"][kv] = fig
        print(f"{kv}: rel {fig['rel_error']:.4g} (decode rows {fig['rel_error_decode']:.4g}), top-1 "
              f"{fig['top1_agreement']:.4f}, greedy {fig['greedy_same']} of {a.gen}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
