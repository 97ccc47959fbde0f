"""Device argmax / sample / update_counts against sample_ref.py.

Tolerance rules:
- argmax, greedy (temperature 0, with or without penalties), update_counts: exact. The penalised, scaled
  logits are bit-identical to the reference (float64 products of counts are exact, see sample_ref.py).
- sampling: the token must equal sample_ref's for the same u = philox_uniform(seed, step), except when a
  decision of the reference is within AMBIG of flipping (SampleTrace.margin() < AMBIG): the kernel sums masses
  in 2^-42 fixed point, truncating each of the V terms, so its prefix masses differ from the float64 ones by
  < V·2^-42 <= 6e-8 of a total that is >= 1 (the best token has mass 1); AMBIG = 1e-6 leaves a 16x margin.
  Such draws are counted and must stay rare (random data puts a boundary within 1e-6 with probability ~1e-6
  per decision), so the check cannot pass vacuously.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.sample import (P_STEP, SampleWorkspace, argmax, pack_sample_params, sample,
                                         update_counts)
from ninfer_numba.kernels.sample_ref import apply_penalties_ref, philox_uniform, sample_ref_detail

AMBIG = 1e-6
needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def make_logits(kind: str, V: int, rng) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal(V) * 3).astype(np.float32)
    if kind == "ties":                       # few distinct values: tie groups decided by index
        return rng.integers(-3, 3, V).astype(np.float32)
    if kind == "neginf":                     # half the vocabulary masked out
        x = (rng.standard_normal(V) * 2).astype(np.float32)
        x[rng.random(V) < 0.5] = -np.inf
        return x
    if kind == "peaked":                     # LLM-like: a few large logits over a flat tail
        x = rng.standard_normal(V).astype(np.float32)
        x[rng.choice(V, 8, replace=False)] += np.float32(12.0)
        return x
    raise ValueError(kind)


class Sampler:
    """Device buffers for one vocabulary size; ``draw`` returns the token the kernels choose."""

    def __init__(self, V: int):
        self.ws = SampleWorkspace(V)
        self.out = cuda.to_device(np.full(1, -1, np.int32))

    def draw(self, logits, counts, cfg: dict, seed: int, step: int) -> int:
        params = cuda.to_device(pack_sample_params(**cfg, seed=seed, step=step))
        self.out.copy_to_device(np.full(1, -1, np.int32))          # poison
        sample(cuda.to_device(logits), cuda.to_device(counts), params, self.out, self.ws)
        assert params.copy_to_host()[P_STEP] == step + 1            # the draw counter advances on the device
        return int(self.out.copy_to_host()[0])


def check_draws(V, kind, cfg, seeds, rng_seed=0, with_counts=False):
    """Run every seed; assert agreement on unambiguous draws; return the number of ambiguous ones."""
    rng = np.random.default_rng(rng_seed)
    logits = make_logits(kind, V, rng)
    counts = np.zeros(V, np.int32)
    pen = {k: cfg.pop(k) for k in ("repetition", "presence", "frequency") if k in cfg}
    if with_counts:
        counts[rng.choice(V, V // 10, replace=False)] = rng.integers(1, 4, V // 10)
    sampler, ambiguous = Sampler(V), 0
    ref_logits = apply_penalties_ref(logits, counts, **pen)
    for seed in seeds:
        step = seed * 7 + 3
        trace = sample_ref_detail(ref_logits, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0),
                                  cfg.get("min_p", 0.0), philox_uniform(seed, step))
        got = sampler.draw(logits, counts, {**cfg, **pen}, seed, step)
        if trace.margin() < AMBIG:
            ambiguous += 1
            continue
        assert got == trace.token, f"seed {seed}: kernel {got}, reference {trace.token} (kept {trace.n_kept})"
    return ambiguous


SIM_CASES = [
    ("V1999-normal-T1", 1999, "normal", dict(temperature=1.0)),
    ("V1999-normal-T0.8-k20-p0.9", 1999, "normal", dict(temperature=0.8, top_k=20, top_p=0.9)),
    ("V2003-normal-p0.5-minp0.05", 2003, "normal", dict(temperature=1.0, top_p=0.5, min_p=0.05)),
    ("V1031-normal-T1.5-k1", 1031, "normal", dict(temperature=1.5, top_k=1)),
    ("V1999-normal-T0.7-k500", 1999, "normal", dict(temperature=0.7, top_k=500)),
    ("V1500-ties-T1", 1500, "ties", dict(temperature=1.0)),
    ("V1500-ties-k300-p0.7", 1500, "ties", dict(temperature=1.0, top_k=300, top_p=0.7)),
    ("V1999-tiny-top_p", 1999, "normal", dict(temperature=1.2, top_p=1e-6)),
    ("V1999-minp0.9", 1999, "peaked", dict(temperature=1.0, min_p=0.9)),
    ("V1777-neginf-T1", 1777, "neginf", dict(temperature=1.0, top_k=900)),
]


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("V,kind,cfg", [c[1:] for c in SIM_CASES], ids=[c[0] for c in SIM_CASES])
def test_sample_tiny(V, kind, cfg):
    assert check_draws(V, kind, dict(cfg), seeds=[V % 97]) == 0


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_sample_penalties_tiny():
    cfg = dict(temperature=0.9, top_k=40, repetition=1.3, presence=0.4, frequency=0.2)
    assert check_draws(1777, "peaked", cfg, seeds=[5], with_counts=True) == 0


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_argmax_and_greedy_tiny(kind):
    V = 2001
    rng = np.random.default_rng(1)
    logits = make_logits(kind, V, rng)
    counts = np.zeros(V, np.int32)
    counts[np.argmax(logits)] = 2                      # penalise the best token: greedy must move
    pen = dict(repetition=1.5, presence=0.5, frequency=0.5)
    sampler = Sampler(V)
    argmax(cuda.to_device(logits), sampler.out, sampler.ws)
    assert int(sampler.out.copy_to_host()[0]) == int(np.argmax(logits))
    got = sampler.draw(logits, counts, dict(temperature=0.0, **pen), seed=1, step=0)
    assert got == int(np.argmax(apply_penalties_ref(logits, counts, **pen)))


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_update_counts():
    counts = cuda.to_device(np.zeros(11, np.int32))
    for t in (3, 3, 10, -1, 11):                        # out-of-range ids are ignored
        update_counts(counts, cuda.to_device(np.array([t], np.int32)))
    want = np.zeros(11, np.int32)
    want[3], want[10] = 2, 1
    np.testing.assert_array_equal(counts.copy_to_host(), want)


GPU_CASES = [
    ("normal-T1", "normal", dict(temperature=1.0)),
    ("normal-T0.6-k20-p0.95", "normal", dict(temperature=0.6, top_k=20, top_p=0.95)),
    ("peaked-T1-p0.9-minp0.05", "peaked", dict(temperature=1.0, top_p=0.9, min_p=0.05)),
    ("ties-k100000-p0.8", "ties", dict(temperature=1.0, top_k=100000, top_p=0.8)),
    ("neginf-T2", "neginf", dict(temperature=2.0)),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind,cfg", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_sample_full_vocab(kind, cfg):
    assert check_draws(248320, kind, dict(cfg), seeds=range(200)) <= 2


@pytest.mark.gpu
@needs_gpu
def test_sample_full_vocab_penalties_and_greedy():
    cfg = dict(temperature=0.8, top_k=50, top_p=0.9, repetition=1.1, presence=0.3, frequency=0.3)
    assert check_draws(248320, "peaked", cfg, seeds=range(100), with_counts=True) <= 1
    for kind in ("normal", "ties"):
        logits = make_logits(kind, 248320, np.random.default_rng(2))
        sampler = Sampler(248320)
        argmax(cuda.to_device(logits), sampler.out, sampler.ws)
        assert int(sampler.out.copy_to_host()[0]) == int(np.argmax(logits))
