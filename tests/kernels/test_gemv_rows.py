"""Batched decode GEMV on int8 tensor cores (q8/gemv_rows.py and its shared-memory ring version,
q8/gemv_rows_ring.py) against q8_matmul_ref, within q8_error_bound (the block products are exact int32, as
in the single-row GEMV: see test_gemv_q8.py)."""
import numpy as np
import pytest

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.q8.gemv_rows import MAX_ROWS, gemv_rows_q8
from ninfer_numba.kernels.q8.gemv_rows_ring import (CONFIG, blocks_per_sm, choose_splits, gemv_rows_ring_q8,
                                                    smem_bytes)
from ninfer_numba.kernels.q8.ref import random_q8_operands
from test_gemv_q8 import check_q8_product

RUNNABLE = pytest.mark.skipif(not (SIMULATOR or gpu_available()), reason="needs the CUDA simulator or a GPU")
GPU = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _run_rows(b, n, k, accumulate, seed, product=None, **kw):
    rng = np.random.default_rng(seed)
    wq, ws, xq, xs = random_q8_operands(rng, b, n, k)
    prior = rng.standard_normal((b, n)).astype(np.float32) if accumulate else None
    out = cuda.to_device(prior if accumulate else np.full((b, n), np.nan, np.float32))      # [B, N]
    (product or gemv_rows_q8)(cuda.to_device(wq), cuda.to_device(ws), cuda.to_device(xq), cuda.to_device(xs),
                              out, accumulate=accumulate, **kw)
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


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("b,n,k,accumulate,config,splits", [
    (1, 1, 256, False, (2, 3), 1),       # one stage: the ring's prologue issues it, the loop waits for it
    (3, 17, 1024, True, (2, 2), 1),      # two stages of a two-slot ring; a second, partial tile
    (8, 40, 1280, False, (4, 3), 2),     # 5 stages over 2 splits (2 and 3); tiles of a block past N
    (11, 9, 768, True, (6, 3), 3),       # two activation tiles, rows 11-15 never loaded; 3 splits
    (16, 33, 512, False, (4, 2), 4),     # more splits than stages: two splits have nothing to do
], ids=["B1-N1-K256", "B3-N17-K1024-acc", "B8-N40-K1280-S2", "B11-N9-K768-acc-S3", "B16-N33-K512-S4"])
def test_gemv_rows_ring_small(b, n, k, accumulate, config, splits):
    """The ring kernel at small shapes: slots reused in turn (more stages than slots), uneven splits, rows
    and activation rows past the ends; a slot read before its copies land or a split left out fails."""
    _run_rows(b, n, k, accumulate, seed=b * 131 + n + k, product=gemv_rows_ring_q8, config=config,
              splits=splits)


def test_ring_splits_fill_waves_and_fit_shared_memory():
    """choose_splits on the 9B's shapes at 132 SMs with 4-warp blocks, 3 per SM at one activation tile (396
    slots) and 2 at two (264): the fewest splits that give 1.9 waves, else the most (4, each >= 4 stages).
    gate|up (1536 tiles): 2 splits at one tile (768 blocks, 1.94 waves), 2 at two (2.9); gdn in (772 tiles):
    4 at one tile (772 blocks, 1.95 waves; 2 splits give 0.97); down (256 tiles) 4; the output head (15520
    tiles) unsplit; K of 2 stages never split. Every CONFIG's ring fits the 227 KB a block may have."""
    w1, s1 = CONFIG[1]
    w2, s2 = CONFIG[2]
    assert (blocks_per_sm(1, w1, s1), blocks_per_sm(2, w2, s2)) == (3, 2)
    assert choose_splits(24576, 4096, w1, s1, 132, 1) == 2
    assert choose_splits(24576, 4096, w2, s2, 132, 2) == 2
    assert choose_splits(12352, 4096, w1, s1, 132, 1) == 4
    assert choose_splits(4096, 12288, w1, s1, 132, 1) == 4
    assert choose_splits(248320, 4096, w1, s1, 132, 1) == 1
    assert choose_splits(4096, 512, w1, s1, 132, 1) == 1
    assert all(smem_bytes(t, w, s) <= 227 * 1024 for t, (w, s) in CONFIG.items())


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["ring", "tiles"])
@pytest.mark.parametrize("b", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", [(4096, 12288), (24576, 4096), (5120, 17408), (6144 + 48, 5120)],
                         ids=["down-9b", "gate-up-9b", "down-27b", "odd-rows"])
def test_gemv_rows_model_shapes(b, n, k, impl):
    _run_rows(b, n, k, accumulate=b % 2 == 0, seed=b + n + k, impl=impl)


def test_gemv_rows_rejects_bad_shapes():
    w = np.zeros((16, 64), np.int8)
    with pytest.raises(ValueError, match="activation rows"):
        gemv_rows_q8(w, None, np.zeros((MAX_ROWS + 1, 64), np.int8), None, None)
    with pytest.raises(ValueError, match="shapes"):
        gemv_rows_q8(w, None, np.zeros((2, 64), np.int8), None, np.zeros((16, 2), np.float32))
    with pytest.raises(ValueError, match="ring kernel needs K"):
        gemv_rows_q8(w, w, np.zeros((2, 64), np.int8), w, np.zeros((2, 16), np.float32), impl="ring")
