"""kernels/fast_launch.py: launches after the first of an argument key skip numba's typing and re-flattening of
device arrays; results must equal numba's own launches, and whatever the fast path cannot type exactly (a
host array) must keep numba's path, copy-back included."""
import numpy as np
import pytest

from ninfer_numba.kernels import fast_launch
from ninfer_numba.kernels.fast_launch import _plannable, arg_key
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda


def test_argument_keys_and_what_can_be_planned():
    a = np.zeros((3, 4), np.float32)
    assert arg_key(a) == (np.ndarray, np.dtype(np.float32), 2, True, False, False)
    assert arg_key(a.T)[3:5] == (False, True) and arg_key(a[:, ::2])[3:5] == (False, False)
    assert arg_key(np.broadcast_to(np.float32(1), (3, 4)))[5] is True
    assert arg_key((1, 2.0)) == (int, float) and arg_key(True) is bool
    assert arg_key(np.float32(2.0))[0] is np.float32 and arg_key(np.int32(3))[0] is np.int32   # 0-d: by type
    assert _plannable((1, 2.0, np.float32(1), np.int64(2), True), object)
    assert not _plannable(a, object) and not _plannable((1, a), object)


@pytest.mark.cudasim
def test_the_simulator_keeps_numbas_launches():
    if not SIMULATOR:
        pytest.skip("the simulator's case")
    assert fast_launch.install() is False


def _axpy():
    @cuda.jit
    def axpy(out, x, a, n):
        i = cuda.grid(1)
        if i < n:
            out[i] = a * x[i] + out[i]
    return axpy


@pytest.mark.gpu
def test_fast_launches_equal_numbas():
    from ninfer_numba.kernels.numba_env import check_numba_cuda
    check_numba_cuda()
    assert fast_launch._installed
    axpy = _axpy()
    n = 1000
    x = cuda.to_device(np.arange(n, dtype=np.float32))
    out = cuda.to_device(np.zeros(n, np.float32))
    for _ in range(3):              # numba's path, then twice the fast one
        axpy[4, 256](out, x, np.float32(2.0), n)
    np.testing.assert_array_equal(out.copy_to_host(), 6 * np.arange(n, dtype=np.float32))
    plans = axpy.__dict__["_ninfer_plans"]
    assert len(plans) == 1 and next(iter(plans.values())) is not False
    assert fast_launch._KARGS in x.__dict__
    half = cuda.to_device(np.zeros(n // 2, np.float32))
    for _ in range(2):              # a strided view: another key, its own parameters
        axpy[2, 256](half, x[::2], np.float32(1.0), n // 2)
    np.testing.assert_array_equal(half.copy_to_host(), 2 * np.arange(0, n, 2, dtype=np.float32))
    host = np.zeros(n, np.float32)
    for _ in range(2):              # a host array: numba's path each time, copied back
        axpy[4, 256](host, x, np.float32(1.0), n)
    np.testing.assert_array_equal(host, 2 * np.arange(n, dtype=np.float32))
    assert sorted(v is False for v in plans.values()) == [False, False, True]
