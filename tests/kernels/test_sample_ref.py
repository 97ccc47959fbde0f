"""The NumPy sampling reference (sample/ref.py): Philox known answers, penalties, and the truncation rules.

All checks here are exact except the statistical one, whose bound is stated next to it.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.sample.ref import (apply_penalties_ref, kept_probs_ref, philox4x32, philox_uniform,
                                             sample_ref, sample_ref_detail)


@pytest.mark.parametrize("counter,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
], ids=["zeros", "ones", "pi"])
def test_philox_known_answers(counter, key, expected):
    """Random123 known-answer vectors for Philox4x32-10."""
    assert philox4x32(counter, key) == expected


def test_philox_uniform_range_and_streams():
    us = [philox_uniform(seed, step) for seed in (0, 1, 2**63 + 5) for step in range(200)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert len(set(us)) == len(us)                       # different (seed, step) give different draws
    assert philox_uniform(7, 3) == philox_uniform(7, 3)
    assert abs(np.mean(us) - 0.5) < 0.05                 # 600 draws: sd of the mean is 0.012


def test_penalties_llama_semantics():
    logits = np.array([2.0, -2.0, 0.0, 3.0, -1.0], np.float32)
    counts = np.array([1, 2, 1, 0, 3], np.int32)
    got = apply_penalties_ref(logits, counts, repetition=2.0, presence=0.5, frequency=0.25)
    # positive divided, non-positive multiplied; then - (0.25·count + 0.5) for count > 0; count 0 untouched
    want = np.array([1.0 - 0.75, -4.0 - 1.0, 0.0 - 0.75, 3.0, -2.0 - 1.25], np.float32)
    np.testing.assert_array_equal(got, want)


def test_greedy_ties_lowest_index():
    logits = np.array([1.0, 5.0, 5.0, -1.0, 5.0], np.float32)
    assert sample_ref(logits, 0.0, 0, 1.0, 0.0, 0.99) == 1
    assert sample_ref(logits, 0.7, 1, 1.0, 0.0, 0.99) == 1    # top_k 1 is greedy too
    # equal logits are ordered by index: the three tied tokens share the mass equally, in order 1, 2, 4
    picks = [sample_ref(logits, 1.0, 3, 1.0, 0.0, u) for u in (0.1, 0.5, 0.9)]
    assert picks == [1, 2, 4]


def test_truncations():
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04])).astype(np.float32)
    assert sample_ref_detail(logits, 1.0, 0, 0.75, 0.0, 0.0).n_kept == 2      # 0.5 + 0.3 >= 0.75
    assert sample_ref_detail(logits, 1.0, 0, 1e-6, 0.0, 0.999).token == 0      # tiny top_p: the top token
    assert sample_ref_detail(logits, 1.0, 0, 1.0, 0.15, 0.0).n_kept == 3       # p >= 0.15·0.5
    assert sample_ref_detail(logits, 1.0, 4, 0.9, 0.0, 0.0).n_kept == 3        # top-p inside the top-k set
    assert sample_ref_detail(logits, 1.0, 2, 1.0, 0.0, 0.0).n_kept == 2
    assert sample_ref_detail(logits, 1.0, 0, 1.0, 1.0, 0.999).token == 0       # min_p 1 keeps only the max


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.8, 0.0), (7, 0.9, 0.05)])
def test_inverse_cdf_matches_probabilities(top_k, top_p, min_p):
    """Frequencies over a fine grid of u equal the truncated softmax: with N evenly spaced u, every count is
    within 1 of N·p (the inverse CDF of a grid is deterministic, no sampling noise)."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(37) * 1.5).astype(np.float32)
    p = kept_probs_ref(logits, 0.9, top_k, top_p, min_p)
    N = 20000
    picks = [sample_ref(logits, 0.9, top_k, top_p, min_p, (j + 0.5) / N) for j in range(N)]
    counts = np.bincount(picks, minlength=logits.shape[0])
    assert np.all(np.abs(counts - N * p) <= 1.0 + 1e-9)
