"""W8A16 prefill GEMM (gemm_w8a16.py) and its Hopper intrinsics (ptx_sm90.py) against NumPy.

Tolerance: weights are dequantized to float16(q · d) exactly as q8.ref.dequant_f16_ref does (checked
bit for bit below), products of two f16 are exact, and the tensor cores' float32 accumulation is bounded by
q8.ref.w8a16_error_bound ((K/16 + 4) · 2u of the absolute sum). A wrong swizzle, fragment, scale or
row shows as errors of the order of the values themselves.

Under the simulator the twins emulate wgmma from the warpgroup's register fragments and the shared bytes
(through the hardware's address swizzle), so the kernel's tiling, copies, fragment order and epilogue run as
on the GPU; the shapes are the smallest that cover every tail: M not a multiple of the tile, N not a
multiple of 128, K = 32 x odd (a final half stage), K/64 odd and even (both register sets of the unrolled
loop), K/64 >= 4 (slot reuse).
"""
import numpy as np
import pytest

from ninfer_numba.kernels import ptx_sm90 as sm90
from ninfer_numba.kernels.q8.gemm_plan import plan, split_ws_floats
from ninfer_numba.kernels.q8.gemm_w8a16 import gemm_w8a16
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.q8.ref import (dequant_f16_ref, fragment_order, random_q8_operands, to_fragment_order,
                                            w8a16_error_bound, w8a16_matmul_ref)


def _has_wgmma():
    return SIMULATOR or (gpu_available() and cuda.get_current_device().compute_capability >= (9, 0))


RUNNABLE = pytest.mark.skipif(not _has_wgmma(), reason="needs the CUDA simulator or an sm_90 GPU")
GPU = pytest.mark.skipif(not (gpu_available() and _has_wgmma()), reason="needs an sm_90 GPU")


def _operands(rng, m, n, k):
    wq, ws, _, _ = random_q8_operands(rng, 0, n, k)
    xh = (rng.standard_normal((m, k)) * 2.0).astype(np.float16)
    return wq, ws, xh


def _run(m, n, k, *, accumulate, seed, ba=None, splits=None):
    """splits None: no workspace (K never split); 0: the model's workspace and the plan's split; n: n splits."""
    rng = np.random.default_rng(seed)
    wq, ws, xh = _operands(rng, m, n, k)
    prior = rng.standard_normal((m, n)).astype(np.float32) if accumulate else None
    out = cuda.to_device(prior if accumulate else np.full((m, n), np.nan, np.float32))
    # NaN-filled: a split that never writes its part shows
    split_ws = None if splits is None else cuda.to_device(np.full(split_ws_floats(132), np.nan, np.float32))
    gemm_w8a16(cuda.to_device(wq), cuda.to_device(ws), cuda.to_device(to_fragment_order(xh)), out,
               accumulate=accumulate, ba=ba, splits=splits or None, split_ws=split_ws)
    got = out.copy_to_host()
    ref, mag = w8a16_matmul_ref(wq, ws, xh, with_abs=True)
    prior64 = 0.0 if prior is None else prior.astype(np.float64)
    bound = w8a16_error_bound(mag, k, prior64)
    assert np.all(np.isfinite(got)), "unwritten (NaN) outputs"
    err = np.abs(got.astype(np.float64) - (ref + prior64))
    worst = np.unravel_index(err.argmax(), err.shape)
    assert np.all(err <= bound), f"max err {err.max():.3g} at {worst} vs bound {bound[worst]:.3g}"


@cuda.jit
def _dequant_kernel(words, scales, out):
    i = cuda.grid(1)
    if i < words.size:
        lo, hi = sm90.dequant_i8x4(words[i], scales[i] | (scales[i] << 16))
        out[2 * i] = lo
        out[2 * i + 1] = hi


@pytest.mark.cudasim
@RUNNABLE
def test_dequant_i8x4_is_float16_of_q_times_d():
    """Every int8 value against scales of every kind (tiny, subnormal products, large, negative)."""
    q = np.arange(-128, 128, dtype=np.int8)
    scales = np.array([1e-2, -3.7e-3, 6e-5, 2.0 ** -24, -650.0, 1.0, 0.0], np.float16)
    wq = np.tile(q, len(scales)).reshape(-1, 32)                         # [56, 32]: 8 rows per scale
    ws = np.repeat(scales, 8)[:, None]                                   # [56, 1]
    words = wq.reshape(-1).view(np.uint32)                               # 4 int8 per word
    sc = np.repeat(ws.view(np.uint16).reshape(-1), 8).astype(np.uint32)  # the scale of each word
    out = cuda.to_device(np.zeros(2 * words.size, np.uint32))
    _dequant_kernel[(words.size + 63) // 64, 64](cuda.to_device(words), cuda.to_device(sc), out)
    got = out.copy_to_host().view(np.float16).reshape(wq.shape)
    np.testing.assert_array_equal(got.view(np.uint16), dequant_f16_ref(wq, ws).view(np.uint16))


def test_plan_fills_the_gpu():
    """256-row activation tiles unless the grid would leave SMs idle (M = 512, N = 4096: 64 tiles of 256);
    K split only where one CTA per tile leaves most SMs idle, and only with room in the workspace."""
    room = split_ws_floats(132)
    assert plan(8192, 24576, 4096, 132, room // (8192 * 24576) or 1) == (256, 1)
    assert plan(2048, 4096, 4096, 132) == (256, 1)
    assert plan(512, 4096, 4096, 132) == (128, 1)
    assert plan(512, 10240, 4096, 132) == (192, 1)     # 240 tiles of 192 in 2 waves, not 320 of 128 in 3
    # 128 rows of the 9B's down projection: 32 tiles of 192 stages; split 4 ways they fill 128 SMs
    assert plan(128, 4096, 12288, 132, room // (128 * 4096)) == (128, 4)
    assert plan(128, 4096, 12288, 132)[1] == 1          # no workspace: no split
    assert plan(2, 4096, 4096, 132, room // (2 * 4096)) == (32, 4)
    assert plan(2, 24576, 4096, 132, room // (2 * 24576)) == (32, 1)   # 192 CTAs fill the SMs already
    assert plan(2, 4096, 4096, 132, 8, ba=128) == (128, 4)


def test_fragment_order_puts_each_lanes_weight_bytes_together():
    """Lane t of a quad needs, for k16 step s of a 32-block, the f16 pairs at k 16s + 2t and 16s + 2t + 8
    (its A fragment): in fragment order those four pairs are the 8 consecutive columns [8t, 8t + 8)."""
    order = fragment_order()
    for t in range(4):
        wanted = [16 * s + 2 * t + 8 * h + e for s in range(2) for h in range(2) for e in range(2)]
        assert sorted(order[wanted]) == list(range(8 * t, 8 * t + 8))


@pytest.mark.cudasim
@RUNNABLE
def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="gemm_w8a16 shapes"):
        gemm_w8a16(np.zeros((64, 48), np.int8), np.zeros((64, 1), np.float16), np.zeros((2, 48), np.float16),
                   np.zeros((2, 64), np.float32))


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("m,n,k,accumulate,ba", [(20, 136, 96, False, 128), (5, 160, 32, True, 256),
                                                 (130, 36, 416, True, 128), (200, 8, 64, False, 192)],
                         ids=["M20-N136-K96", "M5-N160-K32-acc-ba256", "M130-N36-K416-acc", "M200-N8-K64-ba192"])
def test_gemm_w8a16_small(m, n, k, accumulate, ba):
    _run(m, n, k, accumulate=accumulate, seed=m * 41 + n * 3 + k, ba=ba)


@pytest.mark.cudasim
@RUNNABLE
@pytest.mark.parametrize("m,n,k,accumulate,ba,splits", [(3, 136, 416, True, 32, 3), (40, 68, 224, False, 64, 2),
                                                        (9, 8, 160, False, 32, 0)],
                         ids=["M3-N136-K416-acc-ba32-s3", "M40-N68-K224-ba64-s2", "M9-N8-K160-planned"])
def test_gemm_w8a16_split_k_and_small_tiles(m, n, k, accumulate, ba, splits):
    """K split into parts (the last one shorter, with a half stage where K % 64 == 32), summed into out or
    added to it; 32- and 64-row tiles with most of their rows past M."""
    _run(m, n, k, accumulate=accumulate, seed=m * 7 + n + k, ba=ba, splits=splits)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("ba", [128, 192, 256])
@pytest.mark.parametrize("m", [1, 113, 239, 1023, 2048])
@pytest.mark.parametrize("n,k", [(4096, 4096), (12352, 4096), (4096, 12288), (24576, 4096),      # 9B
                                 (16480, 5120), (5120, 17408), (160, 5120), (1028, 96)],          # 27B, tails
                         ids=lambda v: str(v))
def test_gpu_gemm_w8a16_model_shapes(ba, m, n, k):
    _run(m, n, k, accumulate=(m % 2 == 1), seed=m + n + k, ba=ba)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 2, 17, 64, 128, 255])
@pytest.mark.parametrize("n,k", [(4096, 12288), (12352, 4096), (24576, 4096), (1028, 96)], ids=lambda v: str(v))
def test_gpu_gemm_w8a16_planned_splits(m, n, k):
    """The model's call: the workspace given, tile and K splits from the plan (short prompts split K)."""
    _run(m, n, k, accumulate=(m % 2 == 0), seed=m * 3 + n + k, splits=0)


@pytest.mark.gpu
@GPU
def test_gpu_gemm_w8a16_large_m():
    """M = 4099: many row tiles (several rasterization groups) with a ragged last one; 27B-like K."""
    _run(4099, 1024, 5120, accumulate=True, seed=4099)


LIBDEVICE = "/usr/local/cuda/nvvm/libdevice/libdevice.10.bc"


@pytest.mark.skipif(SIMULATOR or gpu_available() or not __import__("os").path.exists(LIBDEVICE),
                    reason="offline PTX check: needs NVVM + libdevice and no GPU (a GPU runs the real tests)")
@pytest.mark.parametrize("ba", [32, 128, 256])
def test_ptx_offline_has_register_operand_wgmma_and_no_local_memory(monkeypatch, ba):
    """Compile the kernel to sm_90a PTX without a device (test-only patches of numba internals, as
    test_flash_attn_mma.py): 4 wgmma per stage with A in registers, accumulators and fragments in
    registers (no local memory)."""
    import types as pytypes

    import numba.cuda.cudadrv.nvrtc as nvrtc_mod
    import numba.cuda.cudadrv.nvvm as nvvm_mod
    import numba.cuda.dispatcher as dispatcher_mod
    from numba import types

    from ninfer_numba.kernels.q8 import gemm_w8a16

    monkeypatch.setattr(dispatcher_mod, "get_current_device",
                        lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    monkeypatch.setattr(nvrtc_mod.config, "FORCE_CUDA_CC", (9, 0, "a"))
    monkeypatch.setattr(nvvm_mod, "get_libdevice", lambda: LIBDEVICE)
    monkeypatch.setattr(nvvm_mod, "open_libdevice", lambda: open(LIBDEVICE, "rb").read())
    sig = (types.Array(types.int8, 2, "C"), types.Array(types.uint16, 1, "C"), types.Array(types.float16, 2, "C"),
           types.Array(types.float32, 2, "C"), types.Array(types.float32, 1, "C"), types.int64, types.int64)
    ptx_text, _ = cuda.compile_ptx(gemm_w8a16._kernel(ba).py_func, sig, cc=(9, 0, "a"), launch_bounds=(256, 1))
    calls = [line for line in ptx_text.splitlines() if "wgmma.mma_async" in line]
    assert len(calls) == 8 and all(f"m64n{ba}k16.f32.f16.f16" in c for c in calls)   # 4 per unrolled half
    assert all("}, {" in c for c in calls)                       # A is a register list, not a descriptor
    assert "ld.local" not in ptx_text and "st.local" not in ptx_text
