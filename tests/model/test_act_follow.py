"""TieFollower (benchmarks/e2e/act_follow.py) with the int8-emulating reference as its own "GPU": its recorded
activations are followed without a change, a level (or, on W8A16 rows, a float16 ulp) moved at a near-tie is
taken, one moved elsewhere is a disagreement. The GPU side is in tests/model/test_gpu_model.py."""
import numpy as np
import pytest

from ninfer_numba.kernels.q8.ref import QK, quantize_q8_blocks_ref
from benchmarks.e2e.act_follow import POINTS, TieFollower, follow_in_pieces
from ninfer_numba.model.reference import ReferenceModel, emulate_activation
from ninfer_numba.model.weights import open_model


def _reference(w, f16_positions=0):
    """The int8-emulating reference, its first f16_positions positions run as W8A16 rows (layers and head)."""
    ref = ReferenceModel(w, emulate_int8=True)
    if f16_positions:
        ref.f16_layer_rows = ref.f16_head_rows = np.arange(64) < f16_positions
    return ref


def _recorded(w, seq, f16_positions=0):
    """The reference's own activations as TieFollower's record (q int8, h16 float16, f16 rows) in its
    order, the h each was made from, and its logits."""
    ref = _reference(w, f16_positions)
    seen = []

    def record(h, f16_rows):
        f16 = np.zeros(len(h), bool) if f16_rows is None else f16_rows
        xq, _ = quantize_q8_blocks_ref(h)
        seen.append((h.copy(), np.where(f16[:, None], 0, xq).astype(np.int8),
                     np.where(f16[:, None], h.astype(np.float16), 0).astype(np.float16), f16.copy()))
        return emulate_activation(h, f16_rows), f16_rows

    ref.act_hook = record
    logits = ref.forward(seq, ref.new_state(len(seq)))
    n = w.config.n_layer
    keys = [(i, p) for i in range(n) for p in POINTS] + [(n, "head")]
    assert len(seen) == len(keys)
    return {k: rec[1:] for k, rec in zip(keys, seen)}, [rec[0] for rec in seen], logits


def _follow(w, seq, acts, f16_positions=0):
    ref = _reference(w, f16_positions)
    ref.act_hook = follower = TieFollower(acts, w.config.n_layer)
    return ref.forward(seq, ref.new_state(len(seq))), follower.report()


def test_own_activations_are_followed_unchanged(tiny_untied):
    w = open_model(tiny_untied)
    seq = np.random.default_rng(1).integers(0, w.config.n_vocab, 12).tolist()
    acts, _, logits = _recorded(w, seq)
    out, rep = _follow(w, seq, acts)
    assert np.array_equal(out, logits)
    assert rep["ties"] == 0 and rep["disagreements"] == 0 and rep["points"] == 4 * w.config.n_layer + 1
    assert rep["f16_elements"] == 0


def test_w8a16_rows_are_followed_and_a_far_ulp_disagrees(tiny_untied):
    """The first 8 of 12 positions as W8A16 rows: the own record is followed unchanged (float16 weights on
    exactly those rows); one float16 value moved by one ulp at the nearest tie is followed, a small one moved
    by two ulps (a fraction of an int8 level) is followed as near, a large one moved by a whole level is a
    disagreement."""
    w = open_model(tiny_untied)
    seq = np.random.default_rng(3).integers(0, w.config.n_vocab, 12).tolist()
    acts, hs, logits = _recorded(w, seq, f16_positions=8)
    out, rep = _follow(w, seq, acts, f16_positions=8)
    assert np.array_equal(out, logits)
    assert rep["f16_elements"] > 0 and rep["f16_ties"] == 0 and rep["disagreements"] == 0
    int8_only = _reference(w).forward(seq, _reference(w).new_state(len(seq)))
    assert not np.array_equal(logits, int8_only)                  # the W8A16 rows really are different
    key = (w.config.n_layer, "head")
    idx = list(acts).index(key)
    q, h16, f16 = acts[key]
    h = hs[idx][:8].astype(np.float64)
    r16 = h16[:8].astype(np.float64)
    up = np.nextafter(h16[:8], np.float16(np.inf)).astype(np.float64)
    frac = np.abs(h - r16) / np.abs(up - r16)                     # distance from its own value, in ulps
    tie = np.unravel_index(np.argmax(np.where(h > r16, frac, 0)), frac.shape)   # nearest the upper midpoint
    small = np.unravel_index(np.argmin(np.where(np.abs(h) > 0, np.abs(h), np.inf)), h.shape)
    big = np.unravel_index(np.argmax(np.abs(h)), h.shape)
    assert frac[tie] > 0.4 and len({tie, small, big}) == 3
    moved = h16.copy()
    moved[tie] = np.nextafter(h16[tie], np.float16(np.inf))
    moved[small] = np.nextafter(np.nextafter(h16[small], np.float16(np.inf)), np.float16(np.inf))
    moved[big] = (h16[big].astype(np.float32) * (1 + 1.0 / 64)).astype(np.float16)    # ~2 levels of its block
    out, rep = _follow(w, seq, {**acts, key: (q, moved, f16)}, f16_positions=8)
    assert rep["f16_ties"] == 1 and rep["f16_near"] == 1 and rep["f16_disagreements"] == 1, rep
    assert rep["disagreements"] == 1 and rep["f16_max_excess"] < 0.1 and rep["f16_max_levels"] > 1.5
    assert not np.array_equal(out, logits)


def test_near_tie_is_followed_and_one_level_off_a_level_or_two_levels_disagree(tiny_untied):
    """A one-level difference at a value next to the midpoint is a rounding decision (followed); at a value
    sitting on a level it is an error of a whole level (loose tie: a disagreement), as two levels are."""
    w = open_model(tiny_untied)
    seq = np.random.default_rng(2).integers(0, w.config.n_vocab, 12).tolist()
    acts, hs, logits = _recorded(w, seq)
    key = (w.config.n_layer, "head")                             # the last point: nothing downstream
    idx = list(acts).index(key)
    q, h16, f16 = acts[key]
    _, d = quantize_q8_blocks_ref(hs[list(acts).index(key)])
    t, k = q.shape
    levels = (hs[idx].astype(np.float64).reshape(t, k // QK, QK) / d[:, :, None]).reshape(t, k)
    frac = np.abs(levels - np.round(levels))
    frac[np.abs(q) >= 126] = 0.25                                # keep clear of the int8 range's edge
    tie = np.unravel_index(np.argmax(frac), frac.shape)           # the element nearest a midpoint
    flat = np.argsort(frac, axis=None)
    on_level, far = (np.unravel_index(i, frac.shape) for i in flat[:2])   # two sitting on a level
    assert frac[tie] > 0.45 and frac[on_level] < 0.05 and frac[far] < 0.05
    moved = q.copy()
    moved[tie] = np.floor(levels[tie]) if q[tie] == np.ceil(levels[tie]) else np.ceil(levels[tie])
    moved[on_level] += 1                                          # one level off a value sitting on a level
    moved[far] += 2                                               # two levels off: no rounding decision
    out, rep = _follow(w, seq, {**acts, key: (moved, h16, f16)})
    assert rep["ties"] == 1 and rep["loose_ties"] == 1 and rep["disagreements"] == 2
    assert rep["excess_at_most"][0] == 1 and 0.45 < rep["max_excess"] < 0.55   # the near-tie; the other: 0.5
    assert not np.array_equal(out, logits)                        # the followed tie changed the run


def test_mismatched_shapes_and_counts_raise(tiny_untied):
    w = open_model(tiny_untied)
    seq = [1, 2, 3, 4]
    acts, _, _ = _recorded(w, seq)
    with pytest.raises(ValueError, match="GPU activation"):
        _follow(w, seq + [5], acts)
    follower = TieFollower(acts, w.config.n_layer)
    with pytest.raises(RuntimeError, match="left GPU rows unread"):
        follower.report()


def _recorded_in_pieces(w, seq, pieces):
    """The reference's own record run in the given forward calls (as a GPU run chunks a prompt and decodes)."""
    ref = _reference(w)
    parts = []

    def record(h, f16_rows):
        xq, _ = quantize_q8_blocks_ref(h)
        parts.append((xq.astype(np.int8), np.zeros(h.shape, np.float16), np.zeros(len(h), bool)))
        return emulate_activation(h, f16_rows), f16_rows

    ref.act_hook = record
    st = ref.new_state(len(seq))
    ends = np.cumsum(pieces)
    logits = np.concatenate([ref.forward(seq[e - n:e], st) for n, e in zip(pieces, ends)])
    n = w.config.n_layer
    keys = [(i, p) for i in range(n) for p in POINTS] + [(n, "head")]
    acts = {k: tuple(np.concatenate([parts[c * len(keys) + x][j] for c in range(len(pieces))])
                     for j in range(3)) for x, k in enumerate(keys)}
    return acts, logits


def test_followed_in_the_gpus_pieces(tiny_untied):
    """A run recorded in prefill chunks and single decode steps is followed unchanged when the reference runs
    the same pieces (its Gated DeltaNet rounds to float16 in the multi-token calls only, as the GPU's
    prefill kernels do); the pieces must cover the sequence."""
    w = open_model(tiny_untied)
    seq = np.random.default_rng(4).integers(0, w.config.n_vocab, 11).tolist()
    pieces = [4, 4, 1, 1, 1]
    acts, logits = _recorded_in_pieces(w, seq, pieces)
    out, follower = follow_in_pieces(w, acts, seq, pieces)
    rep = follower.report()
    assert np.array_equal(out, logits)
    assert rep["ties"] == 0 and rep["disagreements"] == 0
    whole = _reference(w).forward(seq, _reference(w).new_state(len(seq)))
    assert not np.array_equal(whole, logits)      # one call rounds elsewhere: the pieces matter
    with pytest.raises(ValueError, match="do not add up"):
        follow_in_pieces(w, acts, seq, [4, 4])
