"""The int8-emulating reference, end to end, with the kernels' own rounding at near-ties.

Why: an activation whose value lands within float rounding of the midpoint between two int8 levels rounds
one way on the GPU and the other way in NumPy; the one-level difference changes every output of the next
matmul, flips more roundings there, and over the model's ~130 quantization points the two sides end up
apart by the int8 quantization noise itself (model/layer_check.py). No implementation that differs from the
reference in float rounding alone can match it tightly end to end.

What: the GPU run records every int8 activation it feeds a matmul (``gpu_activations``). The reference runs
on its own (its own float values, its own scales, its own quantization) except that, where its int8 value
differs from the GPU's and the GPU's is still a valid rounding of the reference's own value (at most
``0.5 + tol`` levels from it, i.e. a near-tie), it takes the GPU's. A GPU value farther than that is a
disagreement: the reference keeps its own, and it is counted. So every rounding decision of the GPU is
checked against the reference's own value to within ``tol`` of a level, and the end-to-end logits then differ
by float rounding only.

    acts, logits, tokens = gpu_activations(runner, ids, n_gen)
    ref = ReferenceModel(weights, emulate_int8=True)
    follower = TieFollower(acts, n_layer); ref.act_hook = follower
    ref_logits = ref.forward(ids + tokens, ref.new_state(len(ids) + n_gen))   # [P + n_gen, V]
    follower.report()
"""
from __future__ import annotations

import numpy as np

from ninfer_numba.kernels.quant_ref import QK
from ninfer_numba.model.layer_check import tapped_run

POINTS = ("mixer_in", "mixer_out", "ffn_in", "down_in")   # per layer, in the order the matmuls run
TIE_TOL = 0.02                                             # int8 levels beyond the midpoint a near-tie may lie


def gpu_activations(runner, ids: list[int], n_gen: int):
    """tapped_run with every int8 activation recorded: acts {(layer, point): (xq [P + n_gen, K] int8,
    xs [P + n_gen, K/32] float32)} (the head as (n_layer, "head")), logits [P + n_gen, V] at every
    position, and the n_gen greedy tokens."""
    parts: dict[tuple[int, str], list[tuple[np.ndarray, np.ndarray]]] = {}

    def act_tap(i, point, xq, xs):
        parts.setdefault((i, point), []).append((xq.copy_to_host(stream=runner.stream),
                                                 xs.copy_to_host(stream=runner.stream)))
        runner.stream.synchronize()

    logits, toks = tapped_run(runner, ids, n_gen, all_rows=True, act_tap=act_tap)
    acts = {key: (np.concatenate([q for q, _ in v]), np.concatenate([d for _, d in v])) for key, v in parts.items()}
    return acts, logits, toks


class TieFollower:
    """ReferenceModel.act_hook: called with each activation the reference quantizes, in order."""

    def __init__(self, acts: dict, n_layer: int, tol: float = TIE_TOL) -> None:
        self.acts, self.tol = acts, tol
        self.order = [(i, p) for i in range(n_layer) for p in POINTS] + [(n_layer, "head")]
        self.calls = 0
        self.stats: list[dict] = []

    def __call__(self, h: np.ndarray, xq: np.ndarray, xs: np.ndarray) -> np.ndarray:
        """h [T, K] float32 the reference's activation, (xq, xs) its own quantization -> the int8 to use."""
        if self.calls >= len(self.order):
            raise RuntimeError("more quantized activations than the GPU run recorded")
        key = self.order[self.calls]
        self.calls += 1
        gq, _ = self.acts[key]
        if gq.shape != xq.shape:
            raise ValueError(f"{key}: GPU activation {gq.shape} against the reference's {xq.shape}")
        t, k = xq.shape
        scale = np.where(xs == 0, 1.0, xs.astype(np.float64))[:, :, None]
        levels = (h.astype(np.float64).reshape(t, k // QK, QK) / scale).reshape(t, k)   # the reference's value
        differ = gq != xq
        dist = np.abs(levels - gq)
        tie = differ & (dist <= 0.5 + self.tol)
        self.stats.append({"layer": key[0], "point": key[1], "elements": int(xq.size), "ties": int(tie.sum()),
                           "disagreements": int((differ & ~tie).sum()),
                           "max_excess": float(max(dist[differ].max() - 0.5, 0.0)) if differ.any() else 0.0})
        return np.where(tie, gq, xq).astype(np.int8)

    def report(self) -> dict:
        """Totals over every quantization point; max_excess: the farthest the GPU's level lay beyond the
        midpoint of the reference's value (in levels) where the two differ."""
        if self.calls != len(self.order):
            raise RuntimeError(f"the reference quantized {self.calls} activations, the GPU {len(self.order)}")
        return {"tol_levels": self.tol, "points": len(self.stats),
                "elements": sum(s["elements"] for s in self.stats), "ties": sum(s["ties"] for s in self.stats),
                "disagreements": sum(s["disagreements"] for s in self.stats),
                "max_excess": max(s["max_excess"] for s in self.stats),
                "first_disagreement": next((s for s in self.stats if s["disagreements"]), None)}
