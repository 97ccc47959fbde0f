"""Chunked GDN prefill (ninfer_numba/kernels/gdn/chunk.py) against gdn_mixer_ref, and prefill followed
by decode steps against one reference pass over the whole sequence.

cudasim: tiny shapes (run with NUMBA_ENABLE_CUDASIM=1; they also run on a GPU). gpu: 9B and 27B shapes.
Tolerance: relative RMS against the float64 reference that rounds to float16 where the kernels do, within
gdn_cases.rel_budget_f16_emulated (fp32 accumulation, and the float16 roundings it flips); and
against the exact float64 reference within rel_budget_f16 (the float16 operands' own error: the accuracy a
user gets). The conv state is data movement and must match exactly.
"""
import numpy as np
import pytest

from gdn_cases import (EPS, SHAPES_GPU, assert_rel, make_inputs, mixer_reference, needs_gpu,
                       needs_sim_or_gpu, poison, rel_budget_f16,
                       rel_budget_f16_emulated, to_device)
from ninfer_numba.kernels.gdn.chunk import GdnPrefillWorkspace, gdn_prefill
from ninfer_numba.kernels.gdn.chunk_state_f16 import state_tile
from ninfer_numba.kernels.gdn.recurrent import gdn_decode_step, make_decode_sync
from ninfer_numba.kernels.numba_env import cuda


def run_prefill(inp: dict, dev: dict, Hk: int, Hv: int, S: int, T: int, ws_extra: int = 3):
    """Prefill the first T rows; the workspace is larger than T and NaN-poisoned, so reading a row that
    the kernels did not write in this call poisons the output."""
    ws = GdnPrefillWorkspace(T + ws_extra, Hk, Hv, S)
    for arr in ws.arrays():
        poison(arr)
    y = cuda.to_device(np.full((T, Hv * S), np.nan, np.float32))
    gdn_prefill(cuda.to_device(inp["proj"][:T]), dev["conv_w"], dev["conv_state"], dev["ssm_a"],
                dev["dt_bias"], dev["norm_w"], dev["state"], y, Hk, EPS, ws=ws)
    return y.copy_to_host()


def check_prefill(seed, T, Hk, Hv, S, decay="mixed"):
    inp = make_inputs(seed, T, Hk, Hv, S, decay)
    dev = to_device(inp)
    y = run_prefill(inp, dev, Hk, Hv, S, T)
    state = dev["state"].copy_to_host()
    y_em, _, state_em = mixer_reference(inp, Hk, Hv, S, f16_operands=True)
    assert_rel(y, y_em, rel_budget_f16_emulated(S, T), "y (f16 emulated)")
    assert_rel(state, state_em, rel_budget_f16_emulated(S, T), "state (f16 emulated)")
    y_ref, conv_ref, state_ref = mixer_reference(inp, Hk, Hv, S)
    assert_rel(y, y_ref, rel_budget_f16(S, T), "y")
    assert_rel(state, state_ref, rel_budget_f16(S, T), "state")
    np.testing.assert_array_equal(dev["conv_state"].copy_to_host(), conv_ref.astype(np.float32))


def check_prefill_then_decode(seed, T_prefill, n_decode, Hk, Hv, S):
    T = T_prefill + n_decode
    inp = make_inputs(seed, T, Hk, Hv, S)
    dev = to_device(inp)
    ys = [run_prefill(inp, dev, Hk, Hv, S, T_prefill)]
    sync = make_decode_sync(Hk)
    for t in range(T_prefill, T):
        y = cuda.to_device(np.full(Hv * S, np.nan, np.float32))
        gdn_decode_step(cuda.to_device(inp["proj"][t]), dev["conv_w"], dev["conv_state"], dev["ssm_a"],
                        dev["dt_bias"], dev["norm_w"], dev["state"], y, sync, Hk, EPS)
        ys.append(y.copy_to_host()[None])
    y_ref, conv_ref, state_ref = mixer_reference(inp, Hk, Hv, S)    # one pass over all T tokens
    budget = rel_budget_f16(S, T)
    assert_rel(np.concatenate(ys), y_ref, budget, "y")
    assert_rel(dev["state"].copy_to_host(), state_ref, budget, "state")
    np.testing.assert_array_equal(dev["conv_state"].copy_to_host(), conv_ref.astype(np.float32))


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("T,Hk,Hv,S", [(1, 2, 4, 16), (7, 2, 2, 16), (63, 2, 4, 16), (130, 1, 2, 16),
                                       (66, 1, 3, 32), (70, 1, 1, 64)],
                         ids=["T1-Hk2-Hv4-S16", "T7-Hk2-Hv2-S16", "T63-Hk2-Hv4-S16", "T130-Hk1-Hv2-S16",
                              "T66-Hk1-Hv3-S32", "T70-Hk1-Hv1-S64"])     # S64: the 16-row-group tiling of S128
def test_prefill_cudasim(T, Hk, Hv, S):
    check_prefill(10 + T, T, Hk, Hv, S)


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("decay", ["strong", "weak"])
def test_prefill_decay_regimes_cudasim(decay):
    check_prefill(20, 65, 1, 2, 16, decay)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_prefill_then_decode_cudasim():
    check_prefill_then_decode(30, 65, 2, 1, 2, 16)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_prefill_shared_workspace_and_split_cudasim():
    """Without ws= the module's workspace is used and grown; two prefills with carried state equal one."""
    Hk, Hv, S, T = 1, 2, 16, 20
    inp = make_inputs(70, T, Hk, Hv, S)
    dev = to_device(inp)
    ys = []
    for t0, t1 in [(0, 5), (5, T)]:                       # the second call is longer: the workspace grows
        y = cuda.to_device(np.full((t1 - t0, Hv * S), np.nan, np.float32))
        gdn_prefill(cuda.to_device(inp["proj"][t0:t1]), dev["conv_w"], dev["conv_state"], dev["ssm_a"],
                    dev["dt_bias"], dev["norm_w"], dev["state"], y, Hk, EPS)
        ys.append(y.copy_to_host())
    y_ref, conv_ref, state_ref = mixer_reference(inp, Hk, Hv, S)
    assert_rel(np.concatenate(ys), y_ref, rel_budget_f16(S, T), "y")
    assert_rel(dev["state"].copy_to_host(), state_ref, rel_budget_f16(S, T), "state")
    np.testing.assert_array_equal(dev["conv_state"].copy_to_host(), conv_ref.astype(np.float32))


def test_state_tile_fills_one_wave():
    """The state pass's value tile: 32 columns while the blocks fit the SMs at once, else 64."""
    assert state_tile(128, 32, 132) == 32          # 9B: 128 blocks
    assert state_tile(128, 48, 132) == 64          # 27B: 192 blocks of 32 would take two waves
    assert state_tile(128, 48, 0) == 32            # SM count unknown (the simulator)
    assert state_tile(16) == 16 and state_tile(128, 48, 132, bv=16) == 16
    with pytest.raises(ValueError, match="value tile"):
        state_tile(128, bv=24)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_prefill_state_tile_16_cudasim():
    """A value tile of 16 columns: one n8 tile per warp in phases A and B (the second half of each B load
    dropped), two in the state update."""
    Hk, Hv, S, T = 1, 2, 32, 70
    inp = make_inputs(80, T, Hk, Hv, S)
    dev = to_device(inp)
    y = cuda.to_device(np.full((T, Hv * S), np.nan, np.float32))
    gdn_prefill(cuda.to_device(inp["proj"]), dev["conv_w"], dev["conv_state"], dev["ssm_a"], dev["dt_bias"],
                dev["norm_w"], dev["state"], y, Hk, EPS, state_bv=16)
    y_em, _, state_em = mixer_reference(inp, Hk, Hv, S, f16_operands=True)
    assert_rel(y.copy_to_host(), y_em, rel_budget_f16_emulated(S, T), "y")
    assert_rel(dev["state"].copy_to_host(), state_em, rel_budget_f16_emulated(S, T), "state")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model", list(SHAPES_GPU))
@pytest.mark.parametrize("T", [1, 63, 1023, 8192, 32768], ids=lambda t: f"T{t}")
def test_prefill_gpu(model, T):
    Hk, Hv, S = SHAPES_GPU[model]
    check_prefill(40 + T, T, Hk, Hv, S)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("decay", ["strong", "weak"])
def test_prefill_decay_regimes_gpu(decay):
    Hk, Hv, S = SHAPES_GPU["9B"]
    check_prefill(50, 1023, Hk, Hv, S, decay)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model", list(SHAPES_GPU))
def test_prefill_then_decode_gpu(model):
    Hk, Hv, S = SHAPES_GPU[model]
    check_prefill_then_decode(60, 1000, 24, Hk, Hv, S)
