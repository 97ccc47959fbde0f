"""Batched decode GEMV on int8 tensor cores (q8/gemv_rows.py) against q8_matmul_ref, within q8_error_bound
(the block products are exact int32, as in the single-row GEMV: see test_gemv_q8.py)."""
import numpy as np
import pytest

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.q8.gemv_rows import MAX_ROWS, gemv_rows_q8
from ninfer_numba.kernels.q8.ref import random_q8_operands
from test_gemv_q8 import check_q8_product

RUNNABLE = pytest.mark.skipif(not (SIMULATOR or gpu_available()), reason="needs the CUDA simulator or a GPU")
GPU = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _run_rows(b, n, k, accumulate, seed, unroll=None):
    rng = np.random.default_rng(seed)
    wq, ws, xq, xs = random_q8_operands(rng, b, n, k)
    prior = rng.standard_normal((b, n)).astype(np.float32) if accumulate else None
    out = cuda.to_device(prior if accumulate else np.full((b, n), np.nan, np.float32))      # [B, N]
    gemv_rows_q8(cuda.to_device(wq), cuda.to_device(ws), cuda.to_device(xq), cuda.to_device(xs), out,
                 accumulate=accumulate, unroll=unroll)
    check_q8_product(out.copy_to_host(), wq, ws, xq, xs, prior)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("b,n,k,accumulate,unroll", [
    (1, 1, 32, False, None),      # one row, one block: 7 of 8 warps past K/32
    (3, 17, 96, False, None),     # a second row tile of one valid row
    (8, 40, 288, True, 1),        # 9 blocks over 8 warps: one warp takes two, in two steps
    (11, 9, 64, False, None),     # two activation tiles, the second partly past B
    (16, 16, 640, True, 2),       # 20 blocks: three steps of 2 for the first warps, a step past K/32
], ids=["B1-N1-K32", "B3-N17-K96", "B8-N40-K288-acc-u1", "B11-N9-K64", "B16-N16-K640-acc-u2"])
def test_gemv_rows_small(b, n, k, accumulate, unroll):
    _run_rows(b, n, k, accumulate, seed=b * 7919 + n * 31 + k, unroll=unroll)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", [(4096, 12288), (24576, 4096), (5120, 17408), (6144 + 48, 5120)],
                         ids=["down-9b", "gate-up-9b", "down-27b", "odd-rows"])
def test_gemv_rows_model_shapes(b, n, k):
    _run_rows(b, n, k, accumulate=b % 2 == 0, seed=b + n + k)


def test_gemv_rows_rejects_bad_shapes():
    w = np.zeros((16, 64), np.int8)
    with pytest.raises(ValueError, match="activation rows"):
        gemv_rows_q8(w, None, np.zeros((MAX_ROWS + 1, 64), np.int8), None, None)
    with pytest.raises(ValueError, match="shapes"):
        gemv_rows_q8(w, None, np.zeros((2, 64), np.int8), None, np.zeros((16, 2), np.float32))
