"""The reference's dequantized-weight cache (model/weights.py DequantCache): the same logits bit for bit with
and without it, over a prefill call with W8A16 rows and one-token decode calls as the GPU runs them, within
its byte budget, and hitting across calls even when not every matrix fits."""
import numpy as np
import pytest

import ninfer_numba.model.weights as weights_mod
from ninfer_numba.model.reference import ReferenceModel
from ninfer_numba.model.weights import expected_tensors, open_model

PIECES = [7, 1, 1, 1, 1]          # a prefill call (W8A16 rows), then decode steps (int8 rows)


def _run(w, cache_bytes, budget_trace=None):
    ref = ReferenceModel(w, emulate_int8=True, weight_cache_bytes=cache_bytes)
    ref.f16_layer_rows = ref.f16_head_rows = np.arange(sum(PIECES)) < PIECES[0]
    seq = np.random.default_rng(3).integers(0, w.config.n_vocab, sum(PIECES))
    st = ref.new_state(len(seq))
    out, e = [], 0
    for n in PIECES:
        out.append(ref.forward(seq[e:e + n], st))
        e += n
        if budget_trace is not None:
            budget_trace.append(ref.cache.used_bytes)
    return np.concatenate(out), ref.cache


def _matrices(w, layers_only=False) -> dict[str, int]:
    """The matrices the reference multiplies by -> their float32 bytes (token_embd is only read by rows here:
    the file is untied)."""
    return {n: 4 * int(np.prod(shape)) for n, shape, is_matrix in expected_tensors(w.config)
            if is_matrix and n != "token_embd.weight" and not (layers_only and n == "output.weight")}


@pytest.mark.parametrize("window", [None, 4096], ids=["whole-matrices", "row-windows"])
def test_cache_gives_identical_logits(tiny_untied, monkeypatch, window):
    if window is not None:     # several row windows per matrix: cached rows are sliced the same way
        monkeypatch.setattr(weights_mod, "MATMUL_WINDOW_ELEMENTS", window)
    w = open_model(tiny_untied)
    plain, none = _run(w, 0)
    cached, cache = _run(w, 2 * sum(_matrices(w).values()))
    assert none is None
    np.testing.assert_array_equal(cached, plain)
    # taken in on the second ask: the prefill call's float16-rounded weights never (one call), the decode
    # calls' plain ones on the second decode call, hit from the third on
    n_mat = len(_matrices(w))
    assert cache.misses == n_mat and cache.streamed == 2 * n_mat
    assert cache.hits == (len(PIECES) - 3) * n_mat and not any(f16 for _, f16 in cache.entries)


def test_cache_respects_its_budget_and_still_hits(tiny_untied):
    w = open_model(tiny_untied)
    budget = sum(_matrices(w, layers_only=True).values()) // 2     # half of the layers' (the head never fits)
    trace = []
    cached, cache = _run(w, budget, trace)
    np.testing.assert_array_equal(cached, _run(w, 0)[0])
    assert max(trace) <= budget and cache.used_bytes == sum(a.nbytes for a in cache.entries.values())
    # the decode calls sweep all matrices in one order: the pass-aware policy keeps those that fit
    # (plain LRU would evict each one before its next use and never hit)
    n_mat = len(_matrices(w))
    assert cache.streamed > 2 * n_mat and cache.hits > 0 and cache.misses < n_mat


def test_stale_entries_give_way(tiny_untied):
    """Two prefill calls cache the float16-rounded weights; the decode calls after them evict those
    (unused for two calls) for the plain ones."""
    w = open_model(tiny_untied)
    budget = sum(_matrices(w, layers_only=True).values())         # one kind's layer matrices fit, not two
    ref = ReferenceModel(w, emulate_int8=True, weight_cache_bytes=budget)
    ref.f16_layer_rows = ref.f16_head_rows = np.arange(16) < 8
    seq = np.random.default_rng(4).integers(0, w.config.n_vocab, 16)
    st = ref.new_state(len(seq))
    ref.forward(seq[:4], st)
    ref.forward(seq[4:8], st)
    assert ref.cache.entries and all(f16 for _, f16 in ref.cache.entries)
    for t in range(8, 12):
        ref.forward(seq[t:t + 1], st)
        assert ref.cache.used_bytes <= budget
    assert ref.cache.entries and not any(f16 for _, f16 in ref.cache.entries)
