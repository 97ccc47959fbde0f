"""Fused GDN decode step (ninfer_numba/kernels/gdn/recurrent.py) against gdn_mixer_ref, token by token.

cudasim: tiny shapes (run with NUMBA_ENABLE_CUDASIM=1; they also run on a GPU). gpu: 9B and 27B shapes.
Tolerance: relative RMS against the float64 reference within gdn_cases.rel_budget (derived from fp32).
"""
import numpy as np
import pytest

from gdn_cases import (EPS, SHAPES_GPU, assert_rel, make_inputs, mixer_reference, needs_gpu,
                       needs_sim_or_gpu, rel_budget, to_device)
from ninfer_numba.kernels.gdn.recurrent import gdn_decode_step, make_decode_sync
from ninfer_numba.kernels.numba_env import cuda


def run_decode_steps(inp: dict, Hk: int, Hv: int, S: int, n_steps: int):
    """n_steps decode launches on the rows of inp['proj']; returns y [n_steps, Hv*S], conv_state, state."""
    dev = to_device(inp)
    sync = make_decode_sync(Hk)
    ys = []
    for t in range(n_steps):
        y = cuda.to_device(np.full(Hv * S, np.nan, np.float32))           # poisoned: unwritten -> NaN
        gdn_decode_step(cuda.to_device(inp["proj"][t]), dev["conv_w"], dev["conv_state"], dev["ssm_a"],
                        dev["dt_bias"], dev["norm_w"], dev["state"], y, sync, Hk, EPS)
        ys.append(y.copy_to_host())
        assert np.all(sync.counts.copy_to_host() == 0), "arrival counters must be left zeroed for the next launch"
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


def check_batched_decode(Hk, Hv, S, slots, n_slots, n_steps=2):
    """B = len(slots) sequences stepped together: batch row b on state slot slots[b] of [n_slots, ...] slabs,
    each row against the one-sequence reference on its own states; slots no row names stay bit for bit."""
    shared = make_inputs(0, n_steps, Hk, Hv, S)               # the layer's weights, one set for every row
    per_slot = [make_inputs(100 + i, n_steps, Hk, Hv, S) for i in range(n_slots)]
    conv0 = np.stack([p["conv_state"] for p in per_slot])      # [n_slots, K-1, C]
    state0 = np.stack([p["state"] for p in per_slot])          # [n_slots, Hv, S, S]
    dev = to_device(shared)
    conv_d, state_d = cuda.to_device(conv0), cuda.to_device(state0)
    sync = make_decode_sync(Hk, len(slots))
    sync.slots.copy_to_device(np.array(slots, np.int32))
    ys = []
    for t in range(n_steps):
        proj = np.stack([per_slot[s_]["proj"][t] for s_ in slots])                  # [B, P]
        y = cuda.to_device(np.full((len(slots), Hv * S), np.nan, np.float32))
        gdn_decode_step(cuda.to_device(proj), dev["conv_w"], conv_d, dev["ssm_a"], dev["dt_bias"],
                        dev["norm_w"], state_d, y, sync, Hk, EPS)
        ys.append(y.copy_to_host())
        assert np.all(sync.counts.copy_to_host() == 0)
    conv, state = conv_d.copy_to_host(), state_d.copy_to_host()
    budget = rel_budget(S, n_steps)
    for b, s_ in enumerate(slots):
        inp = dict(shared, proj=per_slot[s_]["proj"], conv_state=conv0[s_], state=state0[s_])
        y_ref, conv_ref, state_ref = mixer_reference(inp, Hk, Hv, S, chunked=False)
        assert_rel(np.stack([y[b] for y in ys]), y_ref, budget, f"y of row {b}")
        assert_rel(state[s_], state_ref, budget, f"state of slot {s_}")
        np.testing.assert_array_equal(conv[s_], conv_ref.astype(np.float32))
    for s_ in set(range(n_slots)) - set(slots):
        np.testing.assert_array_equal(state[s_], state0[s_])
        np.testing.assert_array_equal(conv[s_], conv0[s_])


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("Hk,Hv,S,slots,n_slots", [(2, 4, 16, [3, 0, 2], 5), (1, 2, 32, [1], 2)],
                         ids=["B3-of-5-permuted", "B1-slot1"])
def test_decode_batched_cudasim(Hk, Hv, S, slots, n_slots):
    check_batched_decode(Hk, Hv, S, slots, n_slots)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model", list(SHAPES_GPU))
def test_decode_batched_gpu(model):
    Hk, Hv, S = SHAPES_GPU[model]
    check_batched_decode(Hk, Hv, S, [5, 0, 9, 2, 14, 7, 1, 11], 16, n_steps=4)


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
