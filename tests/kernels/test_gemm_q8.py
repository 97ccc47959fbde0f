"""Prefill GEMMs (q8/gemm.py: dp4a tiles; q8/gemm_mma.py: int8 mma.sync) against q8_matmul_ref.

Tolerance: both kernels form each 32-block dot product exactly in int32 and add (ws * xs) * S in float32,
so the error is bounded by q8.ref.q8_error_bound ((K/32 + 4) u of the absolute term sum, plus the
prior value when accumulating; u = 2^-24). The mma path runs under the simulator through a warp
emulation of mma.sync (slow), so its simulator shapes are the smallest that still cover every tail:
M not a multiple of the tile, N not a multiple of 128, K/32 odd.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.q8.gemm import gemm_q8
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.q8.ref import random_q8_operands
from test_gemv_q8 import check_q8_product

RUNNABLE = pytest.mark.skipif(not (SIMULATOR or gpu_available()), reason="needs the CUDA simulator or a GPU")
GPU = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _has_mma():
    return SIMULATOR or (gpu_available() and cuda.get_current_device().compute_capability >= (8, 0))


def _run_gemm(m, n, k, path, accumulate, seed):
    rng = np.random.default_rng(seed)
    wq, ws, xq, xs = random_q8_operands(rng, m, n, k)
    prior = rng.standard_normal((m, n)).astype(np.float32) if accumulate else None
    out = cuda.to_device(prior if accumulate else np.full((m, n), np.nan, np.float32))
    gemm_q8(cuda.to_device(wq), cuda.to_device(ws), cuda.to_device(xq), cuda.to_device(xs), out,
            accumulate=accumulate, path=path)
    check_q8_product(out.copy_to_host(), wq, ws, xq, xs, prior)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("m,n,k,accumulate", [(1, 32, 32, False), (7, 64, 96, False), (113, 96, 64, True),
                                              (70, 96, 96, False)],
                         ids=["M1-N32-K32", "M7-N64-K96", "M113-N96-K64-acc", "M70-N96-K96"])
def test_gemm_q8_dp4a_small(m, n, k, accumulate):
    _run_gemm(m, n, k, "dp4a", accumulate, seed=m * 31 + n * 7 + k)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.skipif(not _has_mma(), reason="int8 mma.sync needs sm_80+")
@pytest.mark.parametrize("m,n,k,accumulate", [(20, 32, 96, False), (5, 160, 32, True)],
                         ids=["M20-N32-K96", "M5-N160-K32-acc"])
def test_gemm_q8_mma_small(m, n, k, accumulate):
    _run_gemm(m, n, k, "mma", accumulate, seed=m * 37 + n * 5 + k)


@pytest.mark.cudasim
@RUNNABLE
def test_gemm_q8_rejects_unknown_path():
    with pytest.raises(ValueError, match="unknown GEMM path"):
        gemm_q8(None, None, None, None, None, path="wgmma")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("path", ["dp4a", "mma"])
@pytest.mark.parametrize("m", [1, 7, 63, 113, 239, 1023])
@pytest.mark.parametrize("n,k", [(4096, 4096), (12352, 4096), (4096, 12288), (24576, 4096),      # 9B
                                 (16480, 5120), (5120, 17408), (160, 5120)], ids=lambda v: str(v))  # 27B
def test_gpu_gemm_q8_model_shapes(path, m, n, k):
    if path == "mma" and not _has_mma():
        pytest.skip("int8 mma.sync needs sm_80+")
    _run_gemm(m, n, k, path, accumulate=(m % 2 == 1), seed=m + n + k)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("path", ["dp4a", "mma"])
def test_gpu_gemm_q8_large_m(path):
    """M = 4099 crosses many M tiles with a ragged last one; 27B-like K."""
    if path == "mma" and not _has_mma():
        pytest.skip("int8 mma.sync needs sm_80+")
    _run_gemm(4099, 1024, 5120, path, accumulate=True, seed=4099)
