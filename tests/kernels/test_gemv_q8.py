"""Decode GEMV (q8/gemv.py) against q8_matmul_ref.

Tolerance: the block dot products are exact int32 (dp4a, then one exact integer add of the two halves),
so the only error is float32 rounding in the scale products and the sum over K/32 blocks, bounded by
q8.ref.q8_error_bound: (K/32 + 4) u times the absolute sum of the terms (plus the prior value when
accumulating), u = 2^-24. A wrong block, scale or lane mapping misses by far more than that.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.q8.gemv import MAX_LOADS, gemv_q8, loads_per_step
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.q8.ref import QK, q8_error_bound, q8_matmul_ref, random_q8_operands

RUNNABLE = pytest.mark.skipif(not (SIMULATOR or gpu_available()), reason="needs the CUDA simulator or a GPU")
GPU = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def check_q8_product(got, wq, ws, xq, xs, prior=None):
    """got: [M, N] float32 kernel result vs the float64 reference (+ prior), within q8_error_bound."""
    ref, mag = q8_matmul_ref(wq, ws, xq, xs, with_abs=True)
    prior64 = 0.0 if prior is None else prior.astype(np.float64)
    want = ref + prior64
    bound = q8_error_bound(mag, wq.shape[1] // QK, prior64)
    assert np.all(np.isfinite(got)), "unwritten (NaN) outputs"
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"max err {err.max():.3g} vs bound {bound[np.unravel_index(err.argmax(), err.shape)]:.3g}"


def test_q8_matmul_ref_matches_int32_block_sums():
    """The float64 reference equals the definition: exact int32 block dot products, then the scales."""
    rng = np.random.default_rng(11)
    m, n, k = 3, 40, 96
    wq, ws, xq, xs = random_q8_operands(rng, m, n, k)
    s = np.einsum("mbi,nbi->mnb", xq.reshape(m, k // QK, QK).astype(np.int64),
                  wq.reshape(n, k // QK, QK).astype(np.int64))             # [M, N, K/32] exact
    terms = s * xs.astype(np.float64)[:, None, :] * ws.astype(np.float64)[None, :, :]
    out, mag = q8_matmul_ref(wq, ws, xq, xs, with_abs=True, row_chunk=16)
    np.testing.assert_allclose(out, terms.sum(2), rtol=1e-12, atol=0)
    assert np.all(mag >= np.abs(terms).sum(2) * (1 - 1e-12))


def _run_gemv(n, k, accumulate, seed):
    rng = np.random.default_rng(seed)
    wq, ws, xq, xs = random_q8_operands(rng, 1, n, k)
    prior = rng.standard_normal((1, n)).astype(np.float32) if accumulate else None
    out = cuda.to_device(prior[0] if accumulate else np.full(n, np.nan, np.float32))   # [N]
    gemv_q8(cuda.to_device(wq), cuda.to_device(ws), cuda.to_device(xq), cuda.to_device(xs), out,
            accumulate=accumulate)
    check_q8_product(out.copy_to_host()[None, :], wq, ws, xq, xs, prior)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("n,k,accumulate", [(1, 32, False), (7, 96, False), (9, 64, True), (5, 4160, False),
                                            (3, 6688, True)],
                         ids=["N1-K32", "N7-K96", "N9-K64-acc", "N5-K4160", "N3-K6688-two-steps-acc"])
def test_gemv_q8_small(n, k, accumulate):
    _run_gemv(n, k, accumulate, seed=n * 7919 + k)


def test_loads_per_step_fill_the_steps():
    """The fewest steps of at most MAX_LOADS loads, each as full as the row allows."""
    assert [loads_per_step(k) for k in (32, 4096, 4160, 5120, 6144, 12288, 17408)] == [1, 8, 9, 10, 6, 8, 9]
    for k in range(32, 40000, 32):
        per_lane, loads = -(-k // 512), loads_per_step(k)
        steps = -(-per_lane // loads)
        assert loads <= MAX_LOADS and steps == -(-per_lane // MAX_LOADS) and steps * loads - per_lane < steps


@pytest.mark.cudasim
@RUNNABLE
def test_gemv_q8_accepts_row_shaped_out():
    """out given as [1, N] (the M = 1 case of the GEMM layout) is written in place."""
    rng = np.random.default_rng(5)
    wq, ws, xq, xs = random_q8_operands(rng, 1, 3, 64)
    out = cuda.to_device(np.full((1, 3), np.nan, np.float32))
    gemv_q8(cuda.to_device(wq), cuda.to_device(ws), cuda.to_device(xq), cuda.to_device(xs), out)
    check_q8_product(out.copy_to_host(), wq, ws, xq, xs)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("n,k", [(12352, 4096), (4096, 4096), (10240, 4096), (24576, 4096), (4096, 12288),
                                 (248320, 4096),                                      # 9B
                                 (16480, 5120), (14336, 5120), (34816, 5120), (5120, 17408), (5120, 6144),
                                 (248320, 5120),                                      # 27B
                                 (1000, 96)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "acc"])
def test_gpu_gemv_q8_model_shapes(n, k, accumulate):
    _run_gemv(n, k, accumulate, seed=n + k)
