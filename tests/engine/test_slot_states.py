"""engine/cache.SlotStates: every slot starts empty (device_array is uninitialised), reset(s) empties slot s
alone, and view(s) is slot s's memory (a prefill on the view lands in the slabs the batched step reads)."""
import numpy as np
import pytest

from tests.gguf_factory import tensors_for, write_gguf
from tests.model.test_gpu_model import SPEC


@pytest.mark.cudasim
def test_slots_start_empty_and_reset_alone(tmp_path):
    from ninfer_numba.engine.cache import SlotStates
    from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
    from ninfer_numba.model.weights import open_model
    if not SIMULATOR and not cuda.is_available():
        pytest.skip("needs the CUDA simulator or a GPU")
    c = open_model(write_gguf(tmp_path / "m.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(2)))).config
    stream = cuda.stream()
    slots = SlotStates(c, 3, 8, stream)
    slabs = list(slots.conv.values()) + list(slots.ssm.values())
    assert slabs and all(not a.copy_to_host(stream=stream).any() for a in slabs)
    rng = np.random.default_rng(5)
    for a in slabs:
        a.copy_to_device(rng.standard_normal(a.shape).astype(np.float32), stream=stream)
    view = slots.view(1)                               # the view writes the slabs' memory
    for a in list(view.conv.values()) + list(view.ssm.values()):
        a.copy_to_device(np.full(a.shape, 7.0, np.float32), stream=stream)
    before = [a.copy_to_host(stream=stream) for a in slabs]
    assert all((b[1] == 7.0).all() for b in before)
    slots.host_pos[1] = 5
    slots.reset(1)
    for a, b in zip(slabs, before):
        got = a.copy_to_host(stream=stream)
        assert not got[1].any()
        np.testing.assert_array_equal(got[[0, 2]], b[[0, 2]])
    assert slots.host_pos == [0, 0, 0]
