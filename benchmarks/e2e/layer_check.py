"""The GPU model against the reference one layer at a time, each reference layer fed the GPU's own input.

End to end, two implementations of the int8-activation model that differ only in float rounding drift
apart: an activation that lands within a rounding error of an int8 rounding boundary rounds one way on one
side and the other way on the other, the one-step difference changes every output of the next matmul, which
flips more roundings there, and over dozens of quantization points the flips cascade until the two differ by
the int8 quantization noise itself. So the tight comparison is local: the residual stream the GPU produced
entering layer i is run through the reference's layer i (a fresh state over the whole sequence: the model is
causal, so prompt and decode positions go through in one call) and compared with the stream the GPU produced
leaving layer i. The head is checked the same way on the GPU's final stream. (benchmarks/e2e/act_follow.py makes
the end-to-end comparison tight instead, by following the GPU's rounding decisions.)

    ``tapped_run(runner, ids, n_gen, all_rows=False, tap=..., act_tap=...)`` -> (logits, tokens, f16)
    ``gpu_residual_streams(runner, ids, n_gen)`` -> (streams, logits, tokens, f16)
    ``compare_layers(weights, streams, logits, emulate_int8=True, f16=None)`` -> report dict

``f16`` says which rows the GPU ran through the W8A16 prefill GEMM (float16 activations): {"layers": bool per
position, "head": bool per returned logits row}; the int8-emulating reference emulates those rows so.
"""
from __future__ import annotations

import numpy as np

from ninfer_numba.model.reference import ReferenceModel


def tapped_run(runner, ids: list[int], n_gen: int, *, all_rows: bool = False,
               **taps) -> tuple[np.ndarray, list[int], dict]:
    """Prompt (prefill kernels) then n_gen greedy tokens (decode kernels, launched eagerly), with the taps
    of model/qwen35.py forward (tap, act_tap). Returns logits [n_gen + 1, V] (after the prompt, then after
    each decode step; with all_rows [len(ids) + n_gen, V], every prompt position), the greedy tokens and the
    W8A16 rows (module docstring) with the lengths of the forward calls the GPU ran ("pieces")."""
    model, s = runner.model, runner.stream
    runner.reset()
    rows: list[np.ndarray] = []
    layer_f16: list[bool] = []
    head_f16: list[bool] = []

    def keep(n: int) -> None:
        rows.append(model.logits[:n].copy_to_host(stream=s))
        s.synchronize()

    def run(part: list[int], every_row: bool) -> list[int]:
        chunks = runner.run_tapped(part, on_chunk=keep if every_row else None, **taps)
        for n in chunks:
            f16 = model.uses_f16_activations(n)
            layer_f16.extend([f16] * n)
            head_f16.extend([f16] * n if every_row else [])
        if not every_row:
            keep(1)
            head_f16.append(False)            # one logits row: the decode path's GEMV
        return list(chunks)

    pieces = run(ids, all_rows)
    toks: list[int] = []
    for _ in range(n_gen):
        toks.append(int(np.argmax(rows[-1][-1])))
        pieces += run([toks[-1]], False)
    return np.concatenate(rows), toks, {"layers": np.array(layer_f16), "head": np.array(head_f16),
                                        "pieces": pieces}


def gpu_residual_streams(runner, ids: list[int], n_gen: int) -> tuple[list[np.ndarray], np.ndarray, list[int], dict]:
    """tapped_run with the residual streams: streams [n_layer + 1] of [P + n_gen, n_embd] float32 (index 0:
    after the embedding, i + 1: after layer i), logits [n_gen + 1, V], the tokens and the W8A16 rows."""
    taps: dict[int, list[np.ndarray]] = {}

    def tap(i, x):
        taps.setdefault(i, []).append(x.copy_to_host(stream=runner.stream))
        runner.stream.synchronize()

    logits, toks, f16 = tapped_run(runner, ids, n_gen, tap=tap)
    streams = [np.concatenate(taps[i]) for i in range(-1, len(runner.model.w.layers))]
    return streams, logits, toks, f16


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare_layers(weights, streams: list[np.ndarray], logits: np.ndarray, *, emulate_int8: bool = True,
                   f16: dict | None = None) -> dict:
    """Per layer: ‖gpu_out − ref_layer(gpu_in)‖ / ‖gpu_out‖ ("rel") and / ‖gpu_out − gpu_in‖ ("rel_update",
    against the layer's own contribution); the head: ‖gpu_logits − ref_head(gpu_final)‖ / ‖ref‖ on the rows
    whose logits the GPU returned (the last len(logits) positions). f16: the W8A16 rows (tapped_run)."""
    ref = ReferenceModel(weights, emulate_int8=emulate_int8)
    n = streams[0].shape[0]
    if f16 is not None:
        ref.f16_layer_rows = f16["layers"]
        ref.f16_head_rows = np.concatenate([np.zeros(n - len(logits), bool), f16["head"]])
    st = ref.new_state(n)
    layers = []
    for i in range(len(streams) - 1):
        x_in, x_out = streams[i], streams[i + 1]
        y = ref.layer(i, x_in, st)
        kind = "attention" if ref.config.is_attention_layer(i) else "gdn"
        layers.append({"layer": i, "kind": kind, "rel": _rel(x_out, y), "rel_update": _rel(x_out - x_in, y - x_in)})
    ref_logits = ref.head(streams[-1][n - len(logits):], n - len(logits))
    return {"emulate_int8": emulate_int8, "layers": layers,
            "max_rel": max(r["rel"] for r in layers), "max_rel_update": max(r["rel_update"] for r in layers),
            "head_rel": _rel(logits, ref_logits),
            "head_top1": float(np.mean(logits.argmax(-1) == ref_logits.argmax(-1)))}
