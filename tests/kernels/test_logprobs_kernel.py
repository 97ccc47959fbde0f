"""Device logprobs (kernels/sample/logprobs.py) against the host's token_logprob (engine/sampling.py): the same
ids in the same order (value descending, index ascending: exact), log-probabilities to float64 rounding of a
sum taken in another order."""
import numpy as np
import pytest

from ninfer_numba.engine.sampling import token_logprob
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.sample.logprobs import MAX_TOP, LogprobWorkspace, record_to_host, token_logprobs

needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")


def logits_of(kind: str, V: int, rng) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal(V) * 3).astype(np.float32)
    if kind == "ties":                                   # few distinct values: order among equals by id
        return rng.integers(-2, 3, V).astype(np.float32)
    x = (rng.standard_normal(V) * 2).astype(np.float32)   # "neginf": most tokens masked out
    x[rng.random(V) < 0.9] = -np.inf
    return x


def check(V: int, kind: str, n_tops, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x = logits_of(kind, V, rng)
    ws = LogprobWorkspace(V)
    d_x = cuda.to_device(x)
    for n in n_tops:
        tok = int(rng.integers(0, V)) if kind != "neginf" else int(np.flatnonzero(np.isfinite(x))[n % 7])
        ws.n_top.copy_to_device(np.array([n], np.int32))
        token_logprobs(d_x, cuda.to_device(np.array([tok], np.int32)), ws)
        rec = ws.rec.copy_to_host()
        got, want = record_to_host(rec, tok, n), token_logprob(x, tok, n)
        assert [t for t, _ in got.top] == [t for t, _ in want.top], (n, got.top[:3], want.top[:3])
        np.testing.assert_allclose([got.logprob] + [v for _, v in got.top],
                                   [want.logprob] + [v for _, v in want.top], rtol=0, atol=1e-9)
        assert (rec[2 + 2 * n::2] == -1).all()           # slots past n are marked empty


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("V,kind", [(1999, "normal"), (2500, "ties"), (3001, "neginf")])
def test_logprobs_tiny(V, kind):
    ws = LogprobWorkspace(V)
    assert ws.grid > 1                                   # the last-block merge is exercised
    check(V, kind, n_tops=[0, 3, MAX_TOP])


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["normal", "ties", "neginf"])
def test_logprobs_full_vocab(kind):
    check(248320, kind, n_tops=[0, 1, 5, MAX_TOP], seed=1)
