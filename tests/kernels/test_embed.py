"""embed_gather_q8 against embed_gather_q8_ref: bit-exact (int8 × float16 is exact in float32).

Outputs are poisoned with NaN before launch, so an unwritten element fails; ids outside [0, V) must give
NaN rows.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.embed import embed_gather_q8, embed_gather_q8_ref
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available

needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _check(V, D, T, seed=0, bad_ids=False):
    rng = np.random.default_rng(seed)
    wq = rng.integers(-128, 128, (V, D), dtype=np.int8)
    ws = (rng.standard_normal((V, D // 32)) * 0.02).astype(np.float16)
    tokens = rng.integers(0, V, T).astype(np.int32)
    if bad_ids:
        tokens[0], tokens[-1] = -1, V
    out = cuda.to_device(np.full((T, D), np.nan, np.float32))
    embed_gather_q8(cuda.to_device(wq), cuda.to_device(ws), cuda.to_device(tokens), out)
    got, want = out.copy_to_host(), embed_gather_q8_ref(wq, ws, tokens)
    np.testing.assert_array_equal(got, want)           # NaN rows compare equal to NaN rows
    assert np.isnan(got).any() == bad_ids


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("V,D,T,bad", [(97, 64, 1, False), (131, 96, 7, False), (50, 160, 5, True)],
                         ids=["V97-D64-T1", "V131-D96-T7", "V50-D160-T5-badids"])
def test_embed_tiny(V, D, T, bad):
    _check(V, D, T, bad_ids=bad)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("D", [4096, 5120], ids=["9B-D4096", "27B-D5120"])
@pytest.mark.parametrize("T", [1, 113, 1023], ids=lambda t: f"T{t}")
def test_embed_full(D, T):
    _check(248320, D, T, seed=T)
