"""Activation quantizers (quant_act.py) against q8/ref.py.

Tolerance rules (u = 2^-24, float32 unit roundoff):
- quantize_rows sees the same float32 inputs as the reference and performs the same correctly rounded
  float32 operations, so xq and xs are bit-exact.
- rmsnorm_quant: the kernel sums x^2 in another order than NumPy. Any order of K non-negative terms
  stays within (K-1)u relative, and sqrt, the divisions and the two products add a few u, so the
  normalized values y agree within rtol = (K + 8)u relative (y_rtol below).
- silu_mul_quant: the GPU expf is within 2 ulp (CUDA C guide, expf) and the other five operations are
  correctly rounded, so y agrees within rtol = 16u (margin 2x over 8u).
- gated_rmsnorm_quant: the GDN output's RMSNorm per head of S (its sum of squares in another order:
  (S - 1)u, plus sqrt, the division and eps a few u) times w and silu(z) (expf within 2 ulp, three
  correctly rounded operations): rtol = (S + 16)u.
- From y to (xq, xs): xs (the block absmax / 127) inherits y's relative bound plus one rounding;
  xq must equal the reference except where the reference's v = y / d lies within the propagated error
  of a .5 rounding boundary, and there it may differ by exactly 1.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.gdn.ref import gated_rmsnorm_ref
from ninfer_numba.kernels.q8.quant_act import gated_rmsnorm_quant, quantize_rows, rmsnorm_quant, silu_mul_quant
from ninfer_numba.kernels.q8.ref import QK, quantize_q8_blocks_ref, rmsnorm_ref, silu_mul_ref

U = 2.0 ** -24
RUNNABLE = pytest.mark.skipif(not (SIMULATOR or gpu_available()), reason="needs the CUDA simulator or a GPU")
GPU = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _outputs(m, k):
    """Device outputs poisoned so unwritten elements fail: xq = -128 (never produced, |q| <= 127), xs = NaN."""
    return cuda.to_device(np.full((m, k), -128, np.int8)), cuda.to_device(np.full((m, k // QK), np.nan, np.float32))


def assert_quant_close(xq, xs, y_ref, rtol):
    """Compare kernel (xq, xs) with the quantization of y_ref under a relative error rtol on y."""
    q_ref, d_ref = quantize_q8_blocks_ref(y_ref)
    assert np.all(np.isfinite(xs)), "unwritten or non-finite scales"
    d_tol = (rtol + 2 * U) * d_ref
    assert np.all(np.abs(xs.astype(np.float64) - d_ref) <= d_tol), \
        f"scale max rel err {np.max(np.abs(xs - d_ref) / np.maximum(d_ref, 1e-30)):.3g} > {rtol:.3g}"
    m, k = y_ref.shape
    d_full = np.repeat(d_ref, QK, axis=1).astype(np.float64)
    v = np.divide(y_ref.astype(np.float64), d_full, out=np.zeros((m, k)), where=d_full > 0)
    near_half = np.abs(np.abs(v) - np.floor(np.abs(v)) - 0.5) <= (2 * rtol + 4 * U) * np.abs(v) + 1e-12
    diff = xq.astype(np.int32) - q_ref.astype(np.int32)
    bad = (diff != 0) & ~(near_half & (np.abs(diff) == 1))
    assert not bad.any(), f"{bad.sum()} quantized values differ beyond the .5-boundary rule, first at " \
                          f"{np.argwhere(bad)[0]}: got {xq[bad][0]}, ref {q_ref[bad][0]}"


def _rand_rows(rng, m, k):
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1))).astype(np.float32)
    x[0, :QK] = 0.0                                   # an all-zero block: d = 0, q = 0
    return x


def _run_quantize_rows(m, k, seed):
    rng = np.random.default_rng(seed)
    x = _rand_rows(rng, m, k)
    xq, xs = _outputs(m, k)
    quantize_rows(cuda.to_device(x), xq, xs)
    q_ref, d_ref = quantize_q8_blocks_ref(x)
    np.testing.assert_array_equal(xs.copy_to_host(), d_ref)
    np.testing.assert_array_equal(xq.copy_to_host(), q_ref)


def _run_rmsnorm_quant(m, k, seed):
    rng = np.random.default_rng(seed)
    x = _rand_rows(rng, m, k)
    x[-1] *= 1e-3                                     # a small-norm row: eps matters
    w = (1.0 + 0.5 * rng.standard_normal(k)).astype(np.float32)
    eps = 1e-6
    xq, xs = _outputs(m, k)
    rmsnorm_quant(cuda.to_device(x), cuda.to_device(w), eps, xq, xs)
    assert_quant_close(xq.copy_to_host(), xs.copy_to_host(), rmsnorm_ref(x, w, eps), (k + 8) * U)


def _run_silu_mul_quant(m, f, seed):
    rng = np.random.default_rng(seed)
    gu = (3.0 * rng.standard_normal((m, 2 * f))).astype(np.float32)
    gu[0, :QK] = -200.0                               # silu underflows to -0: an all-zero block
    xq, xs = _outputs(m, f)
    silu_mul_quant(cuda.to_device(gu), xq, xs)
    assert_quant_close(xq.copy_to_host(), xs.copy_to_host(), silu_mul_ref(gu), 16 * U)


def _run_gated_rmsnorm_quant(m, Hv, S, seed):
    """proj carries z at an offset (as the GDN input projection does) and columns either side of it."""
    rng = np.random.default_rng(seed)
    y = (rng.standard_normal((m, Hv * S)) * rng.uniform(0.01, 5.0, (m, Hv, 1)).repeat(S, 2).reshape(m, -1))
    y = y.astype(np.float32)
    y[0, :S] = 0.0                                    # a zero head: RMS = sqrt(eps), y = 0, d = 0
    z0 = 3 * S + 5
    proj = (2.0 * rng.standard_normal((m, z0 + Hv * S + 7))).astype(np.float32)
    w = (1.0 + 0.3 * rng.standard_normal(S)).astype(np.float32)
    eps = 1e-6
    xq, xs = _outputs(m, Hv * S)
    gated_rmsnorm_quant(cuda.to_device(y), cuda.to_device(proj), z0, cuda.to_device(w), eps, xq, xs)
    ref = gated_rmsnorm_ref(y.reshape(m, Hv, S), proj[:, z0:z0 + Hv * S].reshape(m, Hv, S), w, eps)
    assert_quant_close(xq.copy_to_host(), xs.copy_to_host(), ref.reshape(m, -1), (S + 16) * U)


def test_quantize_ref_error_is_half_a_step():
    """The reference itself: |x - q d| <= d / 2 (+ float32 rounding), |q| <= 127, amax maps to +-127."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((4, 160)) * 3.0).astype(np.float32)
    q, d = quantize_q8_blocks_ref(x)
    d_full = np.repeat(d, QK, axis=1).astype(np.float64)
    assert np.all(np.abs(q.astype(np.int32)) <= 127)
    assert np.all(np.abs(x - q * d_full) <= d_full * (0.5 + 1e-5))
    amax_idx = np.abs(x.reshape(4, 5, QK)).argmax(2)
    assert np.all(np.abs(np.take_along_axis(q.reshape(4, 5, QK), amax_idx[..., None], 2)) == 127)


@pytest.mark.cudasim
@RUNNABLE
def test_quantize_rows_rounds_half_away_from_zero():
    """amax 127 gives d = 1 exactly, so k + 0.5 inputs sit exactly on the rounding boundary."""
    x = np.zeros((1, 2 * QK), np.float32)
    x[0, :8] = [127.0, 2.5, -2.5, 0.5, -0.5, 1.4999999, -126.5, 3.0]
    x[0, QK] = 1e-30                                  # tiny but non-zero amax
    xq, xs = _outputs(1, 2 * QK)
    quantize_rows(cuda.to_device(x), xq, xs)
    q = xq.copy_to_host()
    np.testing.assert_array_equal(q[0, :8], [127, 3, -3, 1, -1, 1, -127, 3])
    assert q[0, QK] == 127 and np.all(q[0, QK + 1:] == 0)
    np.testing.assert_array_equal(xs.copy_to_host(), quantize_q8_blocks_ref(x)[1])


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("m,k", [(1, 32), (3, 96), (2, 4160)], ids=lambda v: str(v))
def test_quantize_rows_bit_exact(m, k):
    _run_quantize_rows(m, k, seed=m * 1000 + k)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("m,k", [(1, 64), (3, 160), (2, 4160)], ids=lambda v: str(v))
def test_rmsnorm_quant(m, k):
    _run_rmsnorm_quant(m, k, seed=m * 1000 + k + 1)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.filterwarnings("ignore:overflow")       # the simulator's expf overflows to inf like the GPU's
@pytest.mark.parametrize("m,f", [(1, 32), (3, 96), (1, 4160)], ids=lambda v: str(v))
def test_silu_mul_quant(m, f):
    _run_silu_mul_quant(m, f, seed=m * 1000 + f + 2)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("m,Hv,S", [(1, 3, 32), (2, 4, 16), (3, 2, 64)], ids=lambda v: str(v))
def test_gated_rmsnorm_quant(m, Hv, S):
    """Heads of one warp's 32-block (S = 32), two heads per 32-block (S = 16), two 32-blocks per head."""
    _run_gated_rmsnorm_quant(m, Hv, S, seed=m * 100 + Hv * 10 + S)


def test_gated_rmsnorm_quant_rejects_straddling_heads():
    with pytest.raises(ValueError, match="head size 48"):
        gated_rmsnorm_quant(None, None, 0, np.zeros(48, np.float32), 1e-6, None, None)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 7, 113, 1023])
@pytest.mark.parametrize("k", [4096, 5120])
def test_gpu_norm_and_quant_model_shapes(m, k):
    _run_quantize_rows(m, k, seed=m + k)
    _run_rmsnorm_quant(m, k, seed=m + k + 1)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 113, 1023])
@pytest.mark.parametrize("f", [12288, 17408])
def test_gpu_silu_mul_quant_model_shapes(m, f):
    _run_silu_mul_quant(m, f, seed=m + f)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("Hv", [32, 48], ids=["9B", "27B"])
def test_gpu_gated_rmsnorm_quant_model_shapes(m, Hv):
    _run_gated_rmsnorm_quant(m, Hv, 128, seed=m + Hv)
