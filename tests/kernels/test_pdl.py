"""Programmatic dependent launch (kernels/pdl.py): marked kernels wait for the grid before them, so launching
them programmatically changes no result, only when they are scheduled.

The simulator has no programmatic launches: there the contract's calls are no-ops and the tests check the
marking. On a GPU (sm_90+ for the launches to be programmatic at all) the decode graphs captured with and
without them give the same logits bit for bit, step after step, and the same greedy and sampled tokens.
"""
import numpy as np
import pytest

from ninfer_numba.kernels import pdl
from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available

# The kernels of a greedy f16 decode step (benchmarks/e2e/decode_profile.py lists them): each keeps the contract.
DECODE_STEP_KERNELS = [
    ("ninfer_numba.kernels.q8.gemv", "_gemv_q8_kernel"),
    ("ninfer_numba.kernels.q8.quant_act", "_rmsnorm_quant_kernel"),
    ("ninfer_numba.kernels.q8.quant_act", "_silu_mul_quant_kernel"),
    ("ninfer_numba.kernels.q8.quant_act", "_quantize_rows_kernel"),
    ("ninfer_numba.kernels.embed", "_embed_q8_kernel"),
    ("ninfer_numba.kernels.position", "_set_kv_len"),
    ("ninfer_numba.kernels.position", "_advance"),
    ("ninfer_numba.kernels.sample.device", "_argmax_kernel"),
]


FACTORY_ARGS = {"_gemv_q8_kernel": (8,), "_gated_rmsnorm_quant_kernel": (32,)}   # where a kernel is made per shape


def _py_func(kernel, name=""):
    if not hasattr(kernel, "py_func") and name in FACTORY_ARGS:
        kernel = kernel(*FACTORY_ARGS[name])
    return getattr(kernel, "py_func", kernel)


@pytest.mark.parametrize("module,name", DECODE_STEP_KERNELS, ids=[n for _, n in DECODE_STEP_KERNELS])
def test_decode_step_kernels_are_marked(module, name):
    import importlib
    kernel = getattr(importlib.import_module(module), name)
    assert getattr(_py_func(kernel, name), "_ninfer_pdl", False), f"{name} is not launched programmatically"


def test_factory_kernels_are_marked():
    from ninfer_numba.kernels.flash_attn.decode import _decode_kernels
    from ninfer_numba.kernels.gdn.recurrent import _decode_kernel
    from ninfer_numba.kernels.q8.quant_act import _gated_rmsnorm_quant_kernel
    for kernel in (*_decode_kernels(4, 2, 32, 4), _decode_kernel(16, 4, 2, 4, False)):
        assert getattr(_py_func(kernel), "_ninfer_pdl", False)
    assert getattr(_py_func(_gated_rmsnorm_quant_kernel, "_gated_rmsnorm_quant_kernel"), "_ninfer_pdl", False)


def test_unmarked_kernels_stay_in_stream_order():
    """Prefill-only kernels are not marked: their launches never get the attribute."""
    from ninfer_numba.kernels.gdn.chunk import _gated_norm_kernel
    assert not getattr(_py_func(_gated_norm_kernel(16, 2, 4)), "_ninfer_pdl", False)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's no-op path")
def test_simulator_has_no_programmatic_launches():
    with pdl.programmatic_launches(True):
        assert not pdl._state.enabled


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR or not gpu_available(), reason="needs a CUDA GPU")
def test_programmatic_decode_graphs_change_nothing(tmp_path):
    from ninfer_numba import SamplingParams
    from tests.model.test_gpu_model import _tiny_gpu_llm
    prompt = np.random.default_rng(4).integers(0, 320, 40).tolist()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    llms = [_tiny_gpu_llm(tmp_path / "a", pdl=False), _tiny_gpu_llm(tmp_path / "b", pdl=True)]
    steps = []
    for llm in llms:
        llm.runner.reset()
        last, out = llm.runner.prefill(prompt), []
        for _ in range(24):
            last = llm.runner.decode(int(np.argmax(last)))
            out.append(np.array(last))
        steps.append(out)
    for i, (a, b) in enumerate(zip(*steps)):
        np.testing.assert_array_equal(a, b, err_msg=f"decode step {i}")
    for params in (SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=5, ignore_eos=True)):
        assert llms[0].generate(prompt, params).token_ids == llms[1].generate(prompt, params).token_ids
