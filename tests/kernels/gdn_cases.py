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


def rel_budget_f16(S: int, T: int, bt: int = 64) -> float:
    """Relative-RMS error budget of the whole prefill, whose state pass multiplies float16 operands.

    The state pass (chunk_state_f16.py) rounds W, q, k and P (in the workspace) and h and V' (in shared
    memory) to float16, unit roundoff 2^-11, and accumulates in float32. Each output passes through about
    four such roundings in sequence per chunk (W h -> V' -> P V' / Kᵀ V'), each at most 2^-11 relative of its
    term, so a chunk contributes 2 · 2^-11 (four independent roundings add as sqrt(4)); the carried state adds
    the chunks' errors as a random walk, as in rel_budget, whose fp32 terms (the rest of the pipeline) are
    added on top.
    """
    n_chunks = (T + bt - 1) // bt
    return 2.0 * 2.0 ** -11 * math.sqrt(n_chunks + 1) + rel_budget(S, T, bt)


def rel_budget_f16_emulated(S: int, T: int, bt: int = 64) -> float:
    """Relative-RMS budget of the prefill against the reference that rounds to float16 where it does.

    The float32 rounding of rel_budget, plus the rounding decisions that differ: a value the kernel has in
    float32 to a relative error e ~ (S + BT)·2^-24 rounds to the other neighbouring float16 than the
    reference's own where it lies within e of a midpoint, a fraction ~e / 2^-10 of the values, each then one
    float16 step (<= 2^-10 relative) away: RMS sqrt(e · 2^-10) per rounding, about four roundings per chunk
    (factor 2), carried as a random walk over the chunks as in rel_budget.
    """
    n_chunks = (T + bt - 1) // bt
    flips = 2.0 * math.sqrt((S + bt) * 2.0 ** -24 * 2.0 ** -10) * math.sqrt(n_chunks + 1)
    return flips + rel_budget(S, T, bt)


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


def mixer_reference(inp: dict, Hk: int, Hv: int, S: int, chunked: bool = True, f16_operands: bool = False):
    """gdn_mixer_ref in float64 on the float32 inputs: (y, conv_state, state); f16_operands: with the
    prefill state pass's float16 roundings emulated (one prefill call over all of inp's tokens)."""
    a = {k: v.astype(np.float64) for k, v in inp.items()}
    return ref.gdn_mixer_ref(a["proj"], a["conv_w"], a["conv_state"], a["ssm_a"], a["dt_bias"], a["norm_w"],
                             a["state"], Hk, Hv, S, EPS, chunked=chunked, f16_operands=f16_operands)


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
