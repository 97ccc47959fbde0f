"""Fused GDN decode step (ninfer_numba/kernels/gdn/recurrent.py) against gdn_mixer_ref, token by token.

cudasim: tiny shapes (run with NUMBA_ENABLE_CUDASIM=1; they also run on a GPU). gpu: 9B and 27B shapes.
Tolerance: relative RMS against the float64 reference within gdn_cases.rel_budget (derived from fp32).
"""
import numpy as np
import pytest

from gdn_cases import (EPS, SHAPES_GPU, assert_rel, make_inputs, mixer_reference, needs_gpu,
                       needs_sim_or_gpu, rel_budget, to_device)
from ninfer_numba.kernels.gdn.recurrent import gdn_decode_step, make_decode_sync_counts
from ninfer_numba.kernels.numba_env import cuda


def run_decode_steps(inp: dict, Hk: int, Hv: int, S: int, n_steps: int):
    """n_steps decode launches on the rows of inp['proj']; returns y [n_steps, Hv*S], conv_state, state."""
    dev = to_device(inp)
    counts = make_decode_sync_counts(Hk)
    ys = []
    for t in range(n_steps):
        y = cuda.to_device(np.full(Hv * S, np.nan, np.float32))           # poisoned: unwritten -> NaN
        gdn_decode_step(cuda.to_device(inp["proj"][t]), dev["conv_w"], dev["conv_state"], dev["ssm_a"],
                        dev["dt_bias"], dev["norm_w"], dev["state"], y, counts, Hk, EPS)
        ys.append(y.copy_to_host())
        assert np.all(counts.copy_to_host() == 0), "arrival counters must be left zeroed for the next launch"
    return np.stack(ys), dev["conv_state"].copy_to_host(), dev["state"].copy_to_host()


def check_decode(seed, Hk, Hv, S, n_steps, decay="mixed"):
    inp = make_inputs(seed, n_steps, Hk, Hv, S, decay)
    y, conv_state, state = run_decode_steps(inp, Hk, Hv, S, n_steps)
    y_ref, conv_ref, state_ref = mixer_reference(inp, Hk, Hv, S, chunked=False)
    budget = rel_budget(S, n_steps)
    assert_rel(y, y_ref, budget, "y")
    assert_rel(state, state_ref, budget, "state")
    np.testing.assert_array_equal(conv_state, conv_ref.astype(np.float32))  # data movement: exact


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("Hk,Hv,S", [(2, 2, 16), (2, 4, 32), (1, 3, 16)],
                         ids=["Hk2-Hv2-S16", "Hk2-Hv4-S32", "Hk1-Hv3-S16"])
def test_decode_steps_cudasim(Hk, Hv, S):
    check_decode(1, Hk, Hv, S, n_steps=3)


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("decay", ["strong", "weak"])
def test_decode_decay_regimes_cudasim(decay):
    check_decode(2, 2, 4, 16, n_steps=2, decay=decay)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model", list(SHAPES_GPU))
@pytest.mark.parametrize("decay", ["mixed", "strong", "weak"])
def test_decode_steps_gpu(model, decay):
    Hk, Hv, S = SHAPES_GPU[model]
    check_decode(3, Hk, Hv, S, n_steps=16, decay=decay)
