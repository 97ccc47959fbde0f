"""TieFollower (model/act_follow.py) with the int8-emulating reference as its own "GPU": its recorded
activations are followed without a change, a level moved at a near-tie is taken, one moved elsewhere is a
disagreement. The GPU side is in tests/model/test_gpu_model.py."""
import numpy as np
import pytest

from ninfer_numba.kernels.quant_ref import QK
from ninfer_numba.model.act_follow import POINTS, TieFollower
from ninfer_numba.model.reference import ReferenceModel
from ninfer_numba.model.weights import open_model


def _recorded(w, seq):
    """The int8-emulating reference's own activations in TieFollower's order, the h each was made from,
    and its logits."""
    ref = ReferenceModel(w, emulate_int8=True)
    seen = []

    def record(h, xq, xs):
        seen.append((h.copy(), xq.copy(), xs.copy()))
        return xq

    ref.act_hook = record
    logits = ref.forward(seq, ref.new_state(len(seq)))
    n = w.config.n_layer
    keys = [(i, p) for i in range(n) for p in POINTS] + [(n, "head")]
    assert len(seen) == len(keys)
    return {k: (q, d) for k, (_, q, d) in zip(keys, seen)}, [h for h, _, _ in seen], logits


def _follow(w, seq, acts):
    ref = ReferenceModel(w, emulate_int8=True)
    ref.act_hook = follower = TieFollower(acts, w.config.n_layer)
    return ref.forward(seq, ref.new_state(len(seq))), follower.report()


def test_own_activations_are_followed_unchanged(tiny_untied):
    w = open_model(tiny_untied)
    seq = np.random.default_rng(1).integers(0, w.config.n_vocab, 12).tolist()
    acts, _, logits = _recorded(w, seq)
    out, rep = _follow(w, seq, acts)
    assert np.array_equal(out, logits)
    assert rep["ties"] == 0 and rep["disagreements"] == 0 and rep["points"] == 4 * w.config.n_layer + 1


def test_one_level_is_followed_with_its_excess_and_two_levels_disagree(tiny_untied):
    w = open_model(tiny_untied)
    seq = np.random.default_rng(2).integers(0, w.config.n_vocab, 12).tolist()
    acts, hs, logits = _recorded(w, seq)
    key = (w.config.n_layer, "head")                             # the last point: nothing downstream
    idx = list(acts).index(key)
    q, d = acts[key]
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
    out, rep = _follow(w, seq, {**acts, key: (moved, d)})
    assert rep["ties"] == 2 and rep["disagreements"] == 1
    assert rep["excess_at_most"][0] == 1 and 0.45 < rep["max_excess"] < 0.55   # the near-tie; the other: 0.5
    assert not np.array_equal(out, logits)                        # the followed ties changed the run


def test_mismatched_shapes_and_counts_raise(tiny_untied):
    w = open_model(tiny_untied)
    seq = [1, 2, 3, 4]
    acts, _, _ = _recorded(w, seq)
    with pytest.raises(ValueError, match="GPU activation"):
        _follow(w, seq + [5], acts)
    follower = TieFollower(acts, w.config.n_layer)
    with pytest.raises(RuntimeError, match="quantized 0 activations"):
        follower.report()
