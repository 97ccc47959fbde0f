"""Quantize-on-append (kernels/kvq/append.py) against kvq/ref.py's quantize + pack.

The kernel rotates in float32, the reference in float64: a code may differ only where the reference's
unit-variance coordinate lies within float32 rounding of a threshold (|y - t| < 1e-5 here, where the
coordinates are O(1) and the rotation sums d terms); norms (float16) must be bit-identical, and every byte
outside the written positions untouched."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from ninfer_numba.kernels.kvq import ref
from ninfer_numba.kernels.kvq.append import KvqTables, kvq_append
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available

needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
SEED = 7


def assert_codes_match(got, x, bits):
    """got [T, Hkv, d] codes equal ref.quantize(x)'s except within 1e-5 of a threshold (module docstring)."""
    want_codes, want_norms = ref.quantize(x, bits, SEED)
    _, thresholds, _ = ref.lloyd_max_gaussian(bits)
    scale = math.sqrt(x.shape[-1]) / np.maximum(want_norms.astype(np.float64), np.finfo(np.float16).tiny)
    y = ref.rotate(x, SEED) * scale[..., None]
    near = np.abs(y[..., None] - thresholds).min(-1) < 1e-5
    assert ((got == want_codes) | near).all(), np.argwhere((got != want_codes) & ~near)[:5]
    assert near.mean() < 1e-3                                            # the allowance stays rare


def check_append(T: int, Hkv: int, d: int, bits: int, pos0: int, max_seq: int, rng) -> None:
    x = (rng.standard_normal((T, Hkv, d)) * rng.uniform(0.1, 30.0, (T, Hkv, 1))).astype(np.float32)
    nb = d * bits // 8
    codes = cuda.to_device(np.full((Hkv, max_seq, nb), 0xAB, np.uint8))
    norms = cuda.to_device(np.full((Hkv, max_seq), 0xCDEF, np.uint16))
    kvq_append(cuda.to_device(x), KvqTables(d, bits, SEED), codes, norms, cuda.to_device(np.array([pos0], np.int32)))
    got_codes, got_norms = codes.copy_to_host(), norms.copy_to_host()
    want_codes, want_norms = ref.quantize(x, bits, SEED)                 # [T, Hkv, d], [T, Hkv]
    rows = slice(pos0, pos0 + T)
    np.testing.assert_array_equal(got_norms[:, rows].T, want_norms.view(np.uint16))
    assert_codes_match(ref.unpack(got_codes[:, rows].transpose(1, 0, 2), bits, d), x, bits)
    outside = np.ones(max_seq, bool)
    outside[rows] = False
    assert (got_codes[:, outside] == 0xAB).all() and (got_norms[:, outside] == 0xCDEF).all()


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("d", [8, 32, 256])
def test_append_tiny(bits, d):
    """d = 8: a warp with idle lanes; 32: shuffles only; 256: shuffles, then three stages across warps."""
    if d * bits % 24 and bits == 3:
        pytest.skip("3-bit rows are whole groups of 8 codes in 3 bytes")
    T = 3 if d <= 32 else 1
    check_append(T=T, Hkv=2, d=d, bits=bits, pos0=5, max_seq=11, rng=np.random.default_rng(bits))


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_append_model_shape(bits):
    """Qwen3.5's attention head (d = 256), a prefill of 300 tokens at position 1000 of a 2048-token cache."""
    check_append(T=300, Hkv=4, d=256, bits=bits, pos0=1000, max_seq=2048, rng=np.random.default_rng(10 + bits))


@pytest.mark.parametrize("d,bits", [(24, 3), (1024 * 2, 4), (32, 2)])
def test_unsupported_shapes_are_refused(d, bits):
    tables = SimpleNamespace(d=d, bits=bits)                 # refused before anything reaches a device
    with pytest.raises(ValueError, match="unsupported kvq append"):
        kvq_append(np.zeros((1, 1, d), np.float32), tables, None, None, None)
