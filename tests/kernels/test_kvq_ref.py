"""The coded KV cache's NumPy reference (kernels/kvq/ref.py): Lloyd-Max codebooks against the literature,
distortion on Gaussian and on outlier-heavy vectors, the rotation, the packing, rotated-domain attention."""
import math

import numpy as np
import pytest

from ninfer_numba.kernels.flash_attn.ref import attention_ref
from ninfer_numba.kernels.kvq import ref

D = 256
# Max (1960), Table I: the unit-Gaussian minimum-MSE quantizers
MAX_1960 = {3: ([0.2451, 0.7560, 1.3440, 2.1520], 0.03455), 4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.2560, 1.6180,
                                                                  2.0690, 2.7330], 0.009497)}
# the acceptance bounds of the KV-cache issue, per coordinate; 8 bits (q8, no bound in the issue): the
# high-resolution (Panter-Dite) distortion sqrt(3)·pi/2 · 2^-16 = 4.15e-5, which the optimum stays under
PANTER_DITE_8 = math.sqrt(3) * math.pi / 2 * 2.0 ** -16
ISSUE_BOUND = {3: 0.036, 4: 0.0097, 8: PANTER_DITE_8}


@pytest.mark.parametrize("bits", [3, 4])
def test_codebook_is_the_lloyd_max_quantizer(bits):
    levels, thresholds, distortion = ref.lloyd_max_gaussian(bits)
    want, want_d = MAX_1960[bits]
    np.testing.assert_allclose(levels[len(levels) // 2:], want, atol=6e-4)
    np.testing.assert_allclose(levels, -levels[::-1], atol=1e-12)
    np.testing.assert_allclose(thresholds, 0.5 * (levels[1:] + levels[:-1]))
    assert abs(distortion - want_d) < 1e-5


def test_eight_bit_codebook_is_near_the_high_resolution_limit():
    levels, thresholds, distortion = ref.lloyd_max_gaussian(8)
    assert len(levels) == 256 and np.all(np.diff(levels) > 0)
    np.testing.assert_allclose(levels, -levels[::-1], atol=1e-12)
    np.testing.assert_allclose(thresholds, 0.5 * (levels[1:] + levels[:-1]))
    assert 0.95 * PANTER_DITE_8 < distortion < PANTER_DITE_8, distortion


def _relative_mse(x, bits, seed=1):
    codes, norms = ref.quantize(x, bits, seed)
    err = ref.dequantize(codes, norms, bits, seed) - x
    return float(np.mean(err ** 2 / (np.sum(x ** 2, axis=-1, keepdims=True) / x.shape[-1])))


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_distortion_on_unit_gaussians_meets_theory(bits):
    x = np.random.default_rng(0).standard_normal((4096, D))
    mse = float(np.mean((ref.dequantize(*ref.quantize(x, bits, 1), bits, 1) - x) ** 2))
    assert mse <= ISSUE_BOUND[bits], mse
    assert mse >= 0.97 * ref.lloyd_max_gaussian(bits)[2], mse      # nothing cheaper than the optimum


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_rotation_spreads_outlier_channels(bits):
    """Keys with a few channels 30x the rest (as trained attention keys have): after the rotation the
    distortion relative to the vector's energy is the Gaussian one; without it a 3-bit code of the raw
    coordinates would lose the small channels entirely."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2048, D))
    x[:, [3, 77, 150]] *= 30.0
    assert _relative_mse(x, bits) <= 1.05 * ISSUE_BOUND[bits]


def test_rotation_is_orthonormal_and_a_hadamard_transform():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, D))
    y = ref.rotate(x, 9)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(ref.rotate_back(y, 9), x, atol=1e-12)
    h = np.array([[1.0]])
    while h.shape[0] < 8:                                   # Sylvester's construction
        h = np.block([[h, h], [h, -h]])
    v = rng.standard_normal(8)
    np.testing.assert_allclose(ref.fwht(v), h @ v, atol=1e-12)
    with pytest.raises(ValueError, match="power of two"):
        ref.fwht(np.zeros(12))


@pytest.mark.parametrize("bits,nbytes", [(3, 96), (4, 128), (8, 256)])
def test_packing_round_trips_at_the_stated_size(bits, nbytes):
    codes = np.random.default_rng(4).integers(0, 1 << bits, (3, 5, D)).astype(np.uint8)
    packed = ref.pack(codes, bits)
    assert packed.shape == (3, 5, nbytes) and packed.dtype == np.uint8
    np.testing.assert_array_equal(ref.unpack(packed, bits, D), codes)
    if bits == 3:                                           # the documented layout: code i at bits 3i of a 24-bit word
        one = np.zeros((1, 8), np.uint8)
        one[0, 2] = 5
        assert ref.pack(one, 3).tolist() == [[5 << 6 & 0xFF, 5 << 6 >> 8, 0]]


@pytest.mark.parametrize("kb,vb", [(3, 3), (4, 3), (4, 4), (8, 8)])
def test_rotated_domain_attention_equals_attention_on_the_decoded_cache(kb, vb):
    rng = np.random.default_rng(5)
    T, H, Hkv, L, d = 3, 4, 2, 9, 64
    q = rng.standard_normal((T, H, d)).astype(np.float32)
    k = rng.standard_normal((L, Hkv, d))
    v = rng.standard_normal((L, Hkv, d))
    kc, kn = ref.quantize(k, kb, 11)
    vc, vn = ref.quantize(v, vb, 12)
    q_pos = np.array([6, 7, 8])
    ours = ref.attention_rotated_ref(q, kc, kn, vc, vn, q_pos, kb, vb, 11, 12)
    dense = attention_ref(q, ref.dequantize(kc, kn, kb, 11), ref.dequantize(vc, vn, vb, 12), q_pos)
    np.testing.assert_allclose(ours, dense, rtol=1e-5, atol=1e-6)
    # against the float cache: a value code moves the output by ~sqrt(D_v) of its size (a weighted mean of
    # errors of relative variance D_v), a key code moves each score by ~sqrt(D_k) (unit q, k) and so the
    # weights by that factor; together ~sqrt(D_k + D_v), with 1.5x room for this small sample
    exact = attention_ref(q, k, v, q_pos)
    rel = np.linalg.norm(ours - exact) / np.linalg.norm(exact)
    bound = 1.5 * math.sqrt(ref.lloyd_max_gaussian(kb)[2] + ref.lloyd_max_gaussian(vb)[2])
    assert rel < bound, (rel, bound)


def test_bad_bit_widths_are_refused():
    with pytest.raises(ValueError, match="bits must be one of"):
        ref.lloyd_max_gaussian(2)
    with pytest.raises(ValueError, match="bits must be one of"):
        ref.pack(np.zeros((1, 8), np.uint8), 5)
