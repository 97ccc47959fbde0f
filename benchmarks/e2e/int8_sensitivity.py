"""How far the int8-emulating reference moves when its input moves by float-rounding amounts.

    python -m benchmarks.e2e.int8_sensitivity --model M.gguf [--tokens 128] [--eps 1e-8,1e-7,1e-6]

Multiplies every embedding element by (1 + eps·N(0, 1)) and reports ‖logits − logits₀‖/‖logits₀‖ and top-1
agreement of the int8-emulating reference (and, for scale, its distance to the float reference). An
implementation that differs from the reference only by float rounding (the GPU: other summation orders)
cannot be expected closer to it than the eps ≈ 1e-8 row: int8 rounding flips cascade through the layers.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--eps", default="1e-8,1e-7,1e-6")
    a = ap.parse_args(argv)
    from ninfer_numba.model.reference import ReferenceModel
    from ninfer_numba.model.weights import open_model
    w = open_model(a.model)
    ids = np.random.default_rng(0).integers(0, w.config.n_vocab, a.tokens)
    embed = w.embed

    def logits(emulate: bool, eps: float = 0.0) -> np.ndarray:
        noise = np.random.default_rng(1)
        w.embed = lambda t: (embed(t) * (1 + eps * noise.standard_normal((len(t), w.config.n_embd)))).astype(
            np.float32)
        ref = ReferenceModel(w, emulate_int8=emulate)
        try:
            return ref.forward(ids, ref.new_state(a.tokens))
        finally:
            w.embed = embed

    def compare(x, y):
        return {"rel": float(np.linalg.norm(x - y) / np.linalg.norm(y)),
                "top1": float(np.mean(x.argmax(-1) == y.argmax(-1)))}

    base = logits(True)
    report = {"model": a.model, "tokens": a.tokens, "int8_vs_float": compare(base, logits(False))}
    for eps in (float(e) for e in a.eps.split(",")):
        report[f"eps={eps:g}"] = compare(logits(True, eps), base)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
