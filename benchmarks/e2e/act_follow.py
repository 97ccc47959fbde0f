"""The int8-emulating reference, end to end, with the kernels' own rounding at near-ties.

Why: an activation whose value lands within float rounding of the midpoint between two int8 levels rounds
one way on the GPU and the other way in NumPy; the one-level difference changes every output of the next
matmul, flips more roundings there, and over the model's ~130 quantization points the two sides end up
apart by the int8 quantization noise itself (benchmarks/e2e/layer_check.py). No implementation that differs from the
reference in float rounding alone can match it tightly end to end.

What: the GPU run records every activation it feeds a matmul (``gpu_activations``): int8 on the decode path
(and on prefill without the W8A16 GEMM), float16 on the W8A16 prefill path. The reference runs on its own
(its own float values, its own scales, its own quantization or float16 rounding) except that it takes the
GPU's value where the two differ by a rounding decision or by the kernels' own float16 arithmetic:

- int8 rows: where the GPU's int8 value is one level from its own and the reference's own value lies near
  the midpoint between the two levels, it takes the GPU's: that is the rounding decision float drift can
  flip. Each one-level element's ``excess`` says how near a tie it was: how far the reference's own value lay
  beyond the midpoint (0: exactly at it; 0.5: on the reference's own level; at most 1). Followed only up to
  ``TIE_BOUND`` (0.1 of a level): a one-level difference further from the midpoint is not a rounding decision
  but an error of up to a level, and counts as a disagreement (``loose_ties``), as two levels or more do; the
  reference keeps its own value there. ``excess_at_most`` is the histogram of all one-level elements.
- float16 rows: one float16 step (ulp) apart is the same rounding decision, followed, with its excess in
  ulps. Further apart but within half an int8 level of the 32-block (amax/254) of the reference's own float32
  value is followed too and counted as ``f16_near``: the kernels compute some products in float16 that the
  reference keeps in float32 (the attention's probabilities), which moves small elements of a block by many
  of their own ulps while staying a fraction of a level (the unit every int8 row is judged in, where a whole
  level is followed). Beyond half a level is a disagreement. ``f16_max_levels`` reports the largest
  difference followed or not.

Which rows were W8A16 comes from the GPU's record too, so the reference multiplies exactly those rows with
float16 weights. Float drift sets the excess. Measured on the H200 (synthetic 9b, 512 + 64 tokens, int8
prefill): at most 0.011 levels at every quantization point but the attention output, where the prefill
kernel's float16 probabilities reach 0.09; one element of 455M at 0.6 (a GDN output).
results/2026-12-01_nvidia-h200_checks/ has the runs.

    acts, logits, tokens, pieces = gpu_activations(runner, ids, n_gen)
    ref_logits, follower = follow_in_pieces(weights, acts, ids + tokens, pieces)   # [P + n_gen, V]
    follower.report()
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from ninfer_numba.kernels.q8.ref import QK, from_fragment_order, quantize_q8_blocks_ref
from benchmarks.e2e.layer_check import tapped_run
from ninfer_numba.model.reference import ReferenceModel, dequantize_activation

POINTS = ("mixer_in", "mixer_out", "ffn_in", "down_in")   # per layer, in the order the matmuls run
EXCESS_BINS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)            # report: one-level elements with excess <= each
TIE_BOUND = 0.1              # largest excess (int8 levels beyond the midpoint) followed as a rounding decision


def gpu_activations(runner, ids: list[int], n_gen: int):
    """tapped_run with every activation recorded: acts {(layer, point): (q [P + n_gen, K] int8, h16 [P + n_gen,
    K] float16, f16 [P + n_gen] bool)}: row r's activation is q[r] (int8 path) or, where f16[r], h16[r] (the
    W8A16 path, back in natural column order); the head as (n_layer, "head"). Also the logits [P + n_gen, V]
    at every position and the n_gen greedy tokens."""
    parts: dict[tuple[int, str], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def act_tap(i, point, q, d):
        host = q.copy_to_host(stream=runner.stream)
        runner.stream.synchronize()
        t, k = host.shape
        if d is None:                                      # float16, fragment order
            rec = (np.zeros((t, k), np.int8), from_fragment_order(host), np.ones(t, bool))
        else:
            rec = (host, np.zeros((t, k), np.float16), np.zeros(t, bool))
        parts.setdefault((i, point), []).append(rec)

    logits, toks, rows = tapped_run(runner, ids, n_gen, all_rows=True, act_tap=act_tap)
    acts = {key: tuple(np.concatenate([r[j] for r in v]) for j in range(3)) for key, v in parts.items()}
    return acts, logits, toks, rows["pieces"]


def default_cache_bytes(fraction: float = 0.4) -> int:
    """``fraction`` of the memory available now (MemAvailable, else the free pages): enough for a 9B file's
    ~36 GB of float32 weights on a 128 GB host, and a bounded share of a small machine."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):                  # not Linux: free pages, which leave out the page cache
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(fraction * avail)


def follow_in_pieces(weights, acts: dict, seq: list[int], pieces: list[int], *, cache_bytes: int | None = None,
                     progress_s: float = 10.0, log=None):
    """The int8-emulating reference with a TieFollower of acts, run over seq in the GPU's own forward calls
    (``pieces``: their lengths, from gpu_activations), so that every kernel's precision is emulated at the
    same rows (the GDN prefill's float16 operands per call, the decode step's float32). Returns the logits
    [len(seq), V] and the follower.

    cache_bytes: the reference's weight cache (ReferenceModel weight_cache_bytes; None: default_cache_bytes(),
    0: none); the decode pieces reuse every matrix, so it saves a dequantization of the file per call. A line
    to ``log`` (default stderr) every ``progress_s`` seconds and after the last call says where the run is."""
    if sum(pieces) != len(seq):
        raise ValueError(f"pieces {pieces} do not add up to the sequence's {len(seq)} tokens")
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cache_bytes = default_cache_bytes() if cache_bytes is None else cache_bytes
    ref = ReferenceModel(weights, emulate_int8=True, weight_cache_bytes=cache_bytes)
    ref.act_hook = follower = TieFollower(acts, weights.config.n_layer)
    st = ref.new_state(len(seq))
    ends = np.cumsum(pieces)
    t0 = last = time.perf_counter()
    logits = []
    for j, (n, e) in enumerate(zip(pieces, ends)):
        logits.append(ref.forward(seq[e - n:e], st))
        now = time.perf_counter()
        if now - last >= progress_s or j == len(pieces) - 1:
            last = now
            log(f"reference: {j + 1}/{len(pieces)} calls, {e}/{len(seq)} tokens, {now - t0:.0f} s" +
                (f"; weight cache {ref.cache.summary()}" if ref.cache is not None else ""))
    return np.concatenate(logits), follower


def _f16_order(h16: np.ndarray) -> np.ndarray:
    """float16 values -> int64 keys in value order (one apart for adjacent float16 values; -0 == +0)."""
    bits = h16.view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


class TieFollower:
    """ReferenceModel.act_hook: called with each activation the reference feeds a matmul, in order. The
    reference may run the sequence in one forward call or in the GPU's own pieces (prefill chunks, then one
    token per step): each point's rows are taken in order."""

    def __init__(self, acts: dict, n_layer: int) -> None:
        self.acts = acts
        self.order = [(i, p) for i in range(n_layer) for p in POINTS] + [(n_layer, "head")]
        self.calls = 0
        self.row0 = {key: 0 for key in self.order}       # the next row of each point's record
        self.stats: list[dict] = []

    def __call__(self, h: np.ndarray, f16_rows=None):
        """h [T, K] float32 the reference's activation -> (the activation to multiply, float32 [T, K]; the
        rows the GPU ran through the W8A16 GEMM, bool [T]). f16_rows (the reference's own guess) is not used:
        the GPU's record says which rows were W8A16."""
        key = self.order[self.calls % len(self.order)]
        self.calls += 1
        r0 = self.row0[key]
        t, k = h.shape
        gq, gh, g16 = (a[r0:r0 + t] for a in self.acts[key])
        if gq.shape != h.shape:
            raise ValueError(f"{key}: GPU activation rows {r0}.. {gq.shape} against the reference's {h.shape}")
        self.row0[key] = r0 + t
        a = np.empty((t, k), np.float32)
        stat = {"layer": key[0], "point": key[1], "elements": 0, "ties": 0, "loose_ties": 0, "disagreements": 0,
                "max_excess": 0.0, "excess_at_most": [0] * len(EXCESS_BINS),
                "f16_elements": 0, "f16_ties": 0, "f16_near": 0, "f16_disagreements": 0, "f16_max_excess": 0.0,
                "f16_max_levels": 0.0}
        if (~g16).any():
            a[~g16] = self._follow_int8(h[~g16], gq[~g16], stat)
        if g16.any():
            a[g16] = self._follow_f16(h[g16], gh[g16], stat)
        self.stats.append(stat)
        return a, g16

    @staticmethod
    def _follow_int8(h: np.ndarray, gq: np.ndarray, stat: dict) -> np.ndarray:
        xq, xs = quantize_q8_blocks_ref(h)
        t, k = xq.shape
        scale = np.where(xs == 0, 1.0, xs.astype(np.float64))[:, :, None]
        levels = (h.astype(np.float64).reshape(t, k // QK, QK) / scale).reshape(t, k)   # the reference's value
        step = np.abs(gq.astype(np.int16) - xq.astype(np.int16))
        one = step == 1
        excess_all = np.zeros(h.shape)
        excess_all[one] = np.maximum(np.abs(levels[one] - gq[one]) - 0.5, 0.0)
        tie = one & (excess_all <= TIE_BOUND)
        loose = one & ~tie
        excess = excess_all[one]
        stat.update(elements=int(xq.size), ties=int(tie.sum()), loose_ties=int(loose.sum()),
                    disagreements=int((step > 1).sum() + loose.sum()),
                    max_excess=float(excess.max()) if excess.size else 0.0,
                    excess_at_most=[int((excess <= b).sum()) for b in EXCESS_BINS])
        return dequantize_activation(np.where(tie, gq, xq), xs)

    @staticmethod
    def _follow_f16(h: np.ndarray, gh: np.ndarray, stat: dict) -> np.ndarray:
        t, k = h.shape
        own = h.astype(np.float16)
        step = np.abs(_f16_order(gh) - _f16_order(own))
        amax = np.abs(h.astype(np.float64)).reshape(t, k // QK, QK).max(axis=2, keepdims=True)
        level = np.broadcast_to(np.where(amax == 0, 1.0, amax / 127.0), (t, k // QK, QK)).reshape(t, k)
        levels = np.abs(gh.astype(np.float64) - h) / level          # the GPU's distance in int8 levels
        tie = step == 1
        near = (step > 1) & (levels <= 0.5)
        far = (step > 1) & (levels > 0.5)
        ulp = np.abs(gh[tie].astype(np.float64) - own[tie].astype(np.float64))
        excess = np.maximum(np.abs(h[tie].astype(np.float64) - gh[tie]) / np.where(ulp == 0, 1, ulp) - 0.5, 0.0)
        stat.update(f16_elements=int(h.size), f16_ties=int(tie.sum()), f16_near=int(near.sum()),
                    f16_disagreements=int(far.sum()), f16_max_excess=float(excess.max()) if excess.size else 0.0,
                    f16_max_levels=float(levels.max()) if levels.size else 0.0)
        stat["disagreements"] += int(far.sum())
        return np.where(tie | near, gh, own).astype(np.float32)

    def report(self) -> dict:
        """Totals over every activation point: int8 elements, ties followed, one-level differences beyond
        TIE_BOUND (loose_ties), disagreements (those, two levels or more, and float16 ones), the largest
        one-level excess and how many one-level elements had an excess of at most each EXCESS_BINS; the
        float16 rows' own counts under f16_* (module docstring)."""
        left = {key: len(self.acts[key][0]) - r0 for key, r0 in self.row0.items() if r0 != len(self.acts[key][0])}
        if self.calls % len(self.order) or left:
            raise RuntimeError(f"the reference stopped inside a forward call or left GPU rows unread: {left}")
        total = lambda name: sum(s[name] for s in self.stats)   # noqa: E731
        return {"points": len(self.stats), "excess_bins": list(EXCESS_BINS),
                "excess_at_most": [sum(s["excess_at_most"][k] for s in self.stats) for k in range(len(EXCESS_BINS))],
                "elements": total("elements"), "ties": total("ties"), "loose_ties": total("loose_ties"),
                "disagreements": total("disagreements"), "tie_bound": TIE_BOUND,
                "max_excess": max(s["max_excess"] for s in self.stats),
                "f16_elements": total("f16_elements"), "f16_ties": total("f16_ties"), "f16_near": total("f16_near"),
                "f16_disagreements": total("f16_disagreements"),
                "f16_max_excess": max(s["f16_max_excess"] for s in self.stats),
                "f16_max_levels": max(s["f16_max_levels"] for s in self.stats),
                "first_disagreement": next((s for s in self.stats if s["disagreements"]), None)}
