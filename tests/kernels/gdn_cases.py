"""Shared inputs, reference runs and error budgets for the GDN kernel tests (test_gdn_decode/prefill)."""
import math

import numpy as np
import pytest

from ninfer_numba.kernels.gdn import ref
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available

EPS = 1e-6                    # Qwen3.5 rms_norm_eps
K_CONV = 4

# cudasim tests also run on a real GPU; without either they skip
needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")

SHAPES_GPU = {"9B": (16, 32, 128), "27B": (16, 48, 128)}     # (Hk, Hv, S)

# log-decay regimes through ssm_a = -exp(a_log): g = ssm_a * softplus(alpha + dt_bias)
DECAY_A_LOG = {"mixed": (-1.0, 1.0), "strong": (1.0, 2.0), "weak": (-7.0, -5.0)}


def rel_budget(S: int, T: int, bt: int = 64) -> float:
    """Relative-RMS error budget of the fp32 kernels against the float64 reference.

    Each stage sums at most S + BT fp32 terms (dot products over S, the triangular solve and P V' over
    a chunk), so one chunk contributes ~(S + BT) * 2^-24 relative error; the carried state adds the
    chunks' errors as a random walk (the decay only shrinks them), giving sqrt(n_chunks + 1); the factor 2
    covers the chained conv / norm / gated-norm stages around the recurrence.
    """
    n_chunks = (T + bt - 1) // bt
    return 2.0 * (S + bt) * 2.0 ** -24 * math.sqrt(n_chunks + 1)


def make_inputs(seed: int, T: int, Hk: int, Hv: int, S: int, decay: str = "mixed") -> dict:
    """float32 layer inputs: projection rows, conv weights/state, gates, norm weight, recurrent state."""
    rng = np.random.default_rng(seed)
    C = 2 * Hk * S + Hv * S
    P = C + Hv * S + 2 * Hv
    lo, hi = DECAY_A_LOG[decay]
    f32 = np.float32
    return {
        "proj": rng.standard_normal((T, P)).astype(f32),
        "conv_w": (rng.standard_normal((C, K_CONV)) * 0.5).astype(f32),
        "conv_state": rng.standard_normal((K_CONV - 1, C)).astype(f32),
        "ssm_a": (-np.exp(rng.uniform(lo, hi, Hv))).astype(f32),
        "dt_bias": rng.uniform(-1.0, 1.0, Hv).astype(f32),
        "norm_w": rng.uniform(0.5, 1.5, S).astype(f32),
        "state": (rng.standard_normal((Hv, S, S)) * 0.1).astype(f32),
    }


def mixer_reference(inp: dict, Hk: int, Hv: int, S: int, chunked: bool = True):
    """gdn_mixer_ref in float64 on the float32 inputs: (y, conv_state, state)."""
    a = {k: v.astype(np.float64) for k, v in inp.items()}
    return ref.gdn_mixer_ref(a["proj"], a["conv_w"], a["conv_state"], a["ssm_a"], a["dt_bias"], a["norm_w"],
                             a["state"], Hk, Hv, S, EPS, chunked=chunked)


def to_device(inp: dict) -> dict:
    return {k: cuda.to_device(v) for k, v in inp.items() if k != "proj"}


def assert_rel(out: np.ndarray, want: np.ndarray, budget: float, what: str) -> None:
    """||out - want|| / ||want|| <= budget, every element finite (catches unwritten NaN-poisoned outputs)."""
    assert np.all(np.isfinite(out)), f"{what}: {np.sum(~np.isfinite(out))} non-finite elements"
    err = float(np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30))
    max_abs = float(np.max(np.abs(out - want)))
    assert err <= budget, f"{what}: relative RMS {err:.3e} > {budget:.3e} (max |err| {max_abs:.3e})"


def poison(arr) -> None:
    """Fill a device array with NaN so any element read before it is written shows up in the output."""
    arr.copy_to_device(np.full(arr.shape, np.nan, arr.dtype))
