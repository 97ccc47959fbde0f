"""Float16 activation kernels (act_f16.py) against q8/ref.py.

Tolerance rules (ref32 = the NumPy float32 value, q8.ref.rmsnorm_ref / silu_mul_ref):
- to_f16 sees the same float32 inputs as NumPy and rounds once to nearest even, so its output is bit-exact
  with ``x.astype(np.float16)``, including ties, overflow to inf, subnormals and -0.
- rmsnorm_f16, silu_mul_f16 and gated_rmsnorm_f16 round their own float32 value once, but that value may differ from ref32 in
  its last bits: the kernel sums x^2 in another order than NumPy (RMSNorm), and the GPU expf is within 2 ulp
  (SiLU; the gated norm has both). Every output must therefore be one of the two float16 neighbours of ref32 (the largest float16
  <= ref32 or the smallest >= ref32; a single value when ref32 is a float16), i.e. within one float16 ulp,
  and at least 99% of the outputs must equal float16(ref32) bit for bit (a float32 difference of a few ulp
  flips the float16 rounding only for values within that distance of a float16 midpoint: ~2^-12 of them).
- Outputs are in fragment order (the W8A16 GEMM's operand layout); every check un-permutes them first
  (q8.ref.from_fragment_order), so a wrong position shows as a wrong value.
- Outputs are poisoned with NaN, with one extra guard row past the M rows passed to the kernel: every
  element of the M rows must be written, the guard row never.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.q8 import act_f16
from ninfer_numba.kernels.gdn.ref import gated_rmsnorm_ref
from ninfer_numba.kernels.q8.act_f16 import gated_rmsnorm_f16, rmsnorm_f16, silu_mul_f16, to_f16
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.q8.ref import (QK, from_fragment_order, rmsnorm_f16_ref, rmsnorm_ref, silu_mul_f16_ref,
                                            silu_mul_ref)

RUNNABLE = pytest.mark.skipif(not (SIMULATOR or gpu_available()), reason="needs the CUDA simulator or a GPU")
GPU = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
EXACT_FRACTION = 0.99


def _launch(launch, m, k):
    """Run launch(out) on an output poisoned with NaN plus a NaN guard row; -> out [M, K] float16 in natural
    column order."""
    buf = cuda.to_device(np.full((m + 1, k), np.nan, np.float16))     # [M + 1, K] float16
    launch(buf[:m])
    host = buf.copy_to_host()
    assert np.isnan(host[m]).all(), "the kernel wrote past its M rows"
    out = host[:m]
    unwritten = np.isnan(out)
    assert not unwritten.any(), f"{unwritten.sum()} outputs unwritten, first at {np.argwhere(unwritten)[0]}"
    return from_fragment_order(out)


def assert_f16_neighbour(got, ref32):
    """got: float16 kernel output; ref32: float32 reference. The rule of the module docstring."""
    r16 = ref32.astype(np.float16)                                    # [M, K] float16(ref32)
    r16_32 = r16.astype(np.float32)
    lo = np.where(r16_32 > ref32, np.nextafter(r16, np.float16(-np.inf)), r16)
    hi = np.where(r16_32 < ref32, np.nextafter(r16, np.float16(np.inf)), r16)
    bad = ~((got >= lo) & (got <= hi))
    assert not bad.any(), f"{bad.sum()} outputs are not float16 neighbours of the float32 reference, first at " \
                          f"{np.argwhere(bad)[0]}: got {got[bad][0]}, ref32 {ref32[bad][0]!r}"
    exact = np.mean(got.view(np.uint16) == r16.view(np.uint16))
    assert exact >= EXACT_FRACTION, f"only {exact:.4%} bit-exact with float16(ref32)"


def _f16(x):
    """NumPy's float32 -> float16 rounding (nearest even, overflow to inf without a warning)."""
    with np.errstate(over="ignore"):
        return x.astype(np.float16)


def _rand_rows(rng, m, k):
    return (rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1))).astype(np.float32)


def _run_to_f16(m, k, seed):
    rng = np.random.default_rng(seed)
    x = _rand_rows(rng, m, k) * np.exp2(rng.integers(-20, 12, (m, k))).astype(np.float32)  # subnormal..inf
    out = _launch(lambda o: to_f16(cuda.to_device(x), o), m, k)
    np.testing.assert_array_equal(out.view(np.uint16), _f16(x).view(np.uint16))


def _run_rmsnorm_f16(m, k, seed):
    rng = np.random.default_rng(seed)
    x = _rand_rows(rng, m, k)
    x[-1] *= 1e-3                                     # a small-norm row: eps matters
    w = (1.0 + 0.5 * rng.standard_normal(k)).astype(np.float32)
    eps = 1e-6
    out = _launch(lambda o: rmsnorm_f16(cuda.to_device(x), cuda.to_device(w), eps, o), m, k)
    assert_f16_neighbour(out, rmsnorm_ref(x, w, eps))


def _run_silu_mul_f16(m, f, seed):
    rng = np.random.default_rng(seed)
    gu = (3.0 * rng.standard_normal((m, 2 * f))).astype(np.float32)
    gu[0, :QK // 2] = -200.0                          # exp(-g) overflows: silu = -0
    gu[0, QK // 2:QK] = 120.0                         # exp(-g) underflows: silu = g
    out = _launch(lambda o: silu_mul_f16(cuda.to_device(gu), o), m, f)
    assert_f16_neighbour(out, silu_mul_ref(gu))


def _run_gated_rmsnorm_f16(m, Hv, S, seed):
    """proj carries z at an offset (as the GDN input projection does) and columns either side of it."""
    rng = np.random.default_rng(seed)
    y = (rng.standard_normal((m, Hv, S)) * rng.uniform(0.01, 5.0, (m, Hv, 1))).astype(np.float32).reshape(m, -1)
    y[0, :S] = 0.0                                    # a zero head: RMS = sqrt(eps), output 0
    z0 = 3 * S + 4
    proj = (2.0 * rng.standard_normal((m, z0 + Hv * S + 8))).astype(np.float32)
    w = (1.0 + 0.3 * rng.standard_normal(S)).astype(np.float32)
    eps = 1e-6
    out = _launch(lambda o: gated_rmsnorm_f16(cuda.to_device(y), cuda.to_device(proj), z0, cuda.to_device(w),
                                              eps, o), m, Hv * S)
    ref = gated_rmsnorm_ref(y.reshape(m, Hv, S), proj[:, z0:z0 + Hv * S].reshape(m, Hv, S), w, eps)
    assert_f16_neighbour(out, ref.reshape(m, -1))


def test_f16_refs_round_the_f32_refs():
    rng = np.random.default_rng(31)
    x, w, gu = _rand_rows(rng, 3, 64), rng.standard_normal(64).astype(np.float32), _rand_rows(rng, 3, 64)
    np.testing.assert_array_equal(rmsnorm_f16_ref(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6).astype(np.float16))
    np.testing.assert_array_equal(silu_mul_f16_ref(gu), silu_mul_ref(gu).astype(np.float16))
    assert rmsnorm_f16_ref(x, w, 1e-6).dtype == silu_mul_f16_ref(gu).dtype == np.float16


def test_neighbour_rule():
    """Either float16 neighbour passes while 99% are exact; two ulp, or one ulp off a float16 value, fails."""
    ref32 = np.tile(np.array([1.0 + 2.0 ** -12, 3.0], np.float32), (100, 1))   # [100, 2]: between 1 and
    got = ref32.astype(np.float16)                                            # 1 + 2^-10; a float16
    got[0, 0] = 1.0 + 2.0 ** -10                                              # the upper neighbour
    assert_f16_neighbour(got, ref32)                                          # 199 of 200 exact
    for bad in (1.0 + 2.0 ** -9, 1.0 - 2.0 ** -11):
        got[0, 0] = bad
        with pytest.raises(AssertionError, match="not float16 neighbours"):
            assert_f16_neighbour(got, ref32)
    got[0, 0], got[1, 1] = 1.0, 3.0 + 2.0 ** -9
    with pytest.raises(AssertionError, match="not float16 neighbours"):
        assert_f16_neighbour(got, ref32)
    got[1, 1], got[:3, 0] = 3.0, 1.0 + 2.0 ** -10
    with pytest.raises(AssertionError, match="bit-exact"):
        assert_f16_neighbour(got, ref32)                                      # 197 of 200 < 99%


@pytest.mark.cudasim
@RUNNABLE
def test_to_f16_rounding_edges():
    """Ties go to even, overflow to inf, 65519 (below the 65520 midpoint) to 65504, subnormals, -0."""
    x = np.zeros((1, 2 * QK), np.float32)
    x[0, :14] = [1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -(1.0 + 2.0 ** -11), 65519.0, 65520.0, 1e6, -1e6,
                 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 3e-5, -0.0, -1e-10, 0.1]
    x[0, QK:] = np.random.default_rng(7).standard_normal(QK)
    out = _launch(lambda o: to_f16(cuda.to_device(x), o), 1, 2 * QK)
    expect = [1.0, 1.0 + 2.0 ** -9, -1.0, 65504.0, np.inf, np.inf, -np.inf, 2.0 ** -24, 0.0, 2.0 ** -24]
    np.testing.assert_array_equal(out[0, :10].astype(np.float64), expect)
    assert np.signbit(out[0, 11]) and np.signbit(out[0, 12]) and out[0, 12] == 0
    np.testing.assert_array_equal(out.view(np.uint16), _f16(x).view(np.uint16))


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("m,k", [(1, 32), (3, 96), (7, 160), (2, 1056)], ids=lambda v: str(v))
@pytest.mark.parametrize("max_blocks", [4096, 1], ids=["grid", "stride"])
def test_to_f16_bit_exact(m, k, max_blocks, monkeypatch):
    monkeypatch.setattr(act_f16, "MAX_BLOCKS", max_blocks)     # 1: one block loops over every chunk
    _run_to_f16(m, k, seed=m * 1000 + k)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("m,k", [(1, 32), (3, 96), (7, 160), (1, 1056), (2, 4160)], ids=lambda v: str(v))
@pytest.mark.parametrize("spread", [1024, 1], ids=["spread", "row"])
def test_rmsnorm_f16(m, k, spread, monkeypatch):
    monkeypatch.setattr(act_f16, "SPREAD_BLOCKS", spread)      # 1: one block per row, several chunks per thread
    _run_rmsnorm_f16(m, k, seed=m * 1000 + k + 1)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.filterwarnings("ignore:overflow")       # the simulator's expf overflows to inf like the GPU's
@pytest.mark.parametrize("m,f", [(1, 32), (3, 96), (7, 160), (1, 1056)], ids=lambda v: str(v))
@pytest.mark.parametrize("spread", [1024, 1], ids=["spread", "row"])
def test_silu_mul_f16(m, f, spread, monkeypatch):
    monkeypatch.setattr(act_f16, "SPREAD_BLOCKS", spread)
    _run_silu_mul_f16(m, f, seed=m * 1000 + f + 2)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.filterwarnings("ignore:overflow")
@pytest.mark.parametrize("m,Hv,S", [(1, 3, 32), (2, 4, 16), (3, 2, 128), (1, 5, 64)], ids=lambda v: str(v))
@pytest.mark.parametrize("spread", [1024, 1], ids=["spread", "row"])
def test_gated_rmsnorm_f16(m, Hv, S, spread, monkeypatch):
    """Heads of 4 to 32 lanes; one block per row loops over the chunks with a partial last warp."""
    monkeypatch.setattr(act_f16, "SPREAD_BLOCKS", spread)
    _run_gated_rmsnorm_f16(m, Hv, S, seed=m * 100 + Hv * 10 + S)


def test_gated_rmsnorm_f16_rejects_wide_heads():
    with pytest.raises(ValueError, match="head size 256"):
        gated_rmsnorm_f16(np.zeros((1, 256), np.float32), None, 0, np.zeros(256, np.float32), 1e-6, None)


@pytest.mark.cudasim
@RUNNABLE
def test_shape_checks():
    with pytest.raises(ValueError, match="to_f16"):
        to_f16(cuda.to_device(np.ones((2, 48), np.float32)), cuda.to_device(np.zeros((2, 48), np.float16)))
    with pytest.raises(ValueError, match="got float32"):
        rmsnorm_f16(cuda.to_device(np.ones((2, 32), np.float32)), cuda.to_device(np.ones(32, np.float32)), 1e-6,
                    cuda.to_device(np.zeros((2, 32), np.float32)))
    with pytest.raises(ValueError, match="silu_mul_f16"):
        silu_mul_f16(cuda.to_device(np.ones((2, 64), np.float32)), cuda.to_device(np.zeros((2, 64), np.float16)))
    to_f16(cuda.to_device(np.ones((0, 32), np.float32)), cuda.to_device(np.zeros((0, 32), np.float16)))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 5, 1000])
@pytest.mark.parametrize("k", [4096, 5120, 12288, 17408])
def test_gpu_to_f16_and_rmsnorm_model_shapes(m, k):
    _run_to_f16(m, k, seed=m + k)
    _run_rmsnorm_f16(m, k, seed=m + k + 1)


@pytest.mark.gpu
@GPU
@pytest.mark.filterwarnings("ignore:overflow")
@pytest.mark.parametrize("m", [1, 5, 1000])
@pytest.mark.parametrize("f", [12288, 17408])
def test_gpu_silu_mul_f16_model_shapes(m, f):
    _run_silu_mul_f16(m, f, seed=m + f + 2)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 1000])
@pytest.mark.parametrize("Hv", [32, 48], ids=["9B", "27B"])
def test_gpu_gated_rmsnorm_f16_model_shapes(m, Hv):
    _run_gated_rmsnorm_f16(m, Hv, 128, seed=m + Hv)
