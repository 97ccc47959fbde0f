"""The int8-emulating reference, end to end, with the kernels' own rounding at near-ties.

Why: an activation whose value lands within float rounding of the midpoint between two int8 levels rounds
one way on the GPU and the other way in NumPy; the one-level difference changes every output of the next
matmul, flips more roundings there, and over the model's ~130 quantization points the two sides end up
apart by the int8 quantization noise itself (model/layer_check.py). No implementation that differs from the
reference in float rounding alone can match it tightly end to end.

What: the GPU run records every int8 activation it feeds a matmul (``gpu_activations``). The reference runs
on its own (its own float values, its own scales, its own quantization) except that, where the GPU's int8
value is one level from its own, it takes the GPU's: that is the rounding decision float drift can flip.
Each such element's ``excess`` says how near a tie it was: how far the reference's own value lay beyond the
midpoint between the two levels (0: exactly at it; 0.5: on the reference's own level; at most 1). A difference of two
levels or more is a disagreement, no rounding decision: the reference keeps its own value and counts it.
The report gives the excess distribution, so the claim "the GPU only ever flipped near-ties" is measured.
Float drift sets the excess. Measured on the H200 (synthetic 9b, 512 + 64 tokens): at most 0.011 levels at
every quantization point but the attention output, where the prefill kernel's float16 probabilities reach
0.09; one element of 455M at 0.6 (a GDN output). results/2026-12-01_nvidia-h200_checks/ has the runs.

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
EXCESS_BINS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)            # report: followed elements with excess <= each


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

    def __init__(self, acts: dict, n_layer: int) -> None:
        self.acts = acts
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
        step = np.abs(gq.astype(np.int16) - xq.astype(np.int16))
        tie, far = step == 1, step > 1
        excess = np.maximum(np.abs(levels[tie] - gq[tie]) - 0.5, 0.0)
        self.stats.append({"layer": key[0], "point": key[1], "elements": int(xq.size), "ties": int(tie.sum()),
                           "disagreements": int(far.sum()),
                           "max_excess": float(excess.max()) if excess.size else 0.0,
                           "excess_at_most": [int((excess <= b).sum()) for b in EXCESS_BINS]})
        return np.where(tie, gq, xq).astype(np.int8)

    def report(self) -> dict:
        """Totals over every quantization point: elements, ties followed, disagreements (two levels or more
        apart), the largest excess and how many followed ties had an excess of at most each EXCESS_BINS."""
        if self.calls != len(self.order):
            raise RuntimeError(f"the reference quantized {self.calls} activations, the GPU {len(self.order)}")
        return {"points": len(self.stats), "excess_bins": list(EXCESS_BINS),
                "excess_at_most": [sum(s["excess_at_most"][k] for s in self.stats) for k in range(len(EXCESS_BINS))],
                "elements": sum(s["elements"] for s in self.stats), "ties": sum(s["ties"] for s in self.stats),
                "disagreements": sum(s["disagreements"] for s in self.stats),
                "max_excess": max(s["max_excess"] for s in self.stats),
                "first_disagreement": next((s for s in self.stats if s["disagreements"]), None)}
