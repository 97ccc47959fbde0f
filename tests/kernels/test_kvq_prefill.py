"""Prefill attention over the 3/4-bit cache (kernels/kvq/prefill.py) against a float64 emulation of what it
computes: the query rotated and rounded to float16, the decoded rotated keys and values rounded to float16
(kvq/ref.py's decode_rotated), softmax attention in float64, rotated back, gated. What the emulation leaves
out is the kernel's float32 accumulation and its float16 P before P·V (relative 2^-11 of Σ w|v|, the f16
kernel's own bound: tests/kernels/test_flash_attn_mma.py), so outputs agree to 5e-4 of their scale (measured
8.5e-5 in the simulator); the
emulation itself agrees with attention_rotated_ref (no float16 roundings) to within the roundings' effect.
Cache rows past the last query's position hold NaN norms: reading one would fail the test."""
import math

import numpy as np
import pytest

from ninfer_numba.kernels.kvq import ref
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available

needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
K_SEED, V_SEED = 21, 22
NAN_F16 = 0x7E00


def emulate(q, kc, kn, vc, vn, pos0, k_bits, v_bits, gate):
    """What the kernel computes, float64 past its float16 roundings: [T, H·d]."""
    T, H, d = q.shape
    G = H // kc.shape[1]
    f16 = lambda a: np.asarray(a).astype(np.float16).astype(np.float64)      # noqa: E731
    qr = f16(ref.rotate(q, K_SEED).astype(np.float32))
    kr = np.repeat(f16(ref.decode_rotated(kc, kn, k_bits).astype(np.float32)), G, axis=1)   # [L, H, d]
    vr = np.repeat(f16(ref.decode_rotated(vc, vn, v_bits).astype(np.float32)), G, axis=1)
    s = np.einsum("thd,lhd->thl", qr, kr) / math.sqrt(d)
    L = kc.shape[0]
    s = np.where(np.arange(L)[None, None, :] <= (pos0 + np.arange(T))[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = ref.rotate_back(np.einsum("thl,lhd->thd", p, vr), V_SEED)
    return (o / (1 + np.exp(-gate.astype(np.float64)))).reshape(T, H * d)


def check_prefill(T, H, Hkv, d, pos0, k_bits, v_bits, rng, max_seq=None, n_warps=4):
    from ninfer_numba.kernels.kvq.prefill import kvq_attention_prefill
    L = pos0 + T
    max_seq = max_seq or L + 5
    q = (rng.standard_normal((T, H, d)) * 1.5).astype(np.float16)
    k = rng.standard_normal((L, Hkv, d)).astype(np.float32) * rng.uniform(0.5, 3, (L, Hkv, 1))
    v = rng.standard_normal((L, Hkv, d)).astype(np.float32)
    kc, kn = ref.quantize(k, k_bits, K_SEED)
    vc, vn = ref.quantize(v, v_bits, V_SEED)

    def cache(codes, norms, bits):
        c = np.full((Hkv, max_seq, d * bits // 8), 0xFF, np.uint8)
        n = np.full((Hkv, max_seq), NAN_F16, np.uint16)
        c[:, :L] = ref.pack(codes, bits).transpose(1, 0, 2)
        n[:, :L] = norms.view(np.uint16).T
        return cuda.to_device(c), cuda.to_device(n)
    proj = rng.standard_normal((T, 2 * d * H + 2 * d * Hkv)).astype(np.float32)
    gate = proj[:, :2 * d * H].reshape(T, H, 2, d)[:, :, 1]
    out = cuda.to_device(np.full((T, H * d), np.nan, np.float32))
    d_q = cuda.to_device(q)
    kvq_attention_prefill(d_q, *cache(kc, kn, k_bits), *cache(vc, vn, v_bits), cuda.to_device(
        np.array([pos0], np.int32)), KvqTables(d, k_bits, K_SEED), KvqTables(d, v_bits, V_SEED),
        cuda.to_device(proj), out, n_warps=n_warps)
    want = emulate(q.astype(np.float32), kc, kn, vc, vn, pos0, k_bits, v_bits, gate)
    got = out.copy_to_host()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-4 * np.abs(want).max())
    # the queries are left rotated, rounded to float16
    np.testing.assert_allclose(d_q.copy_to_host().astype(np.float32), ref.rotate(q.astype(np.float32), K_SEED),
                               rtol=0, atol=2 ** -10 * np.abs(q).max() * 2)
    return got, want


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("k_bits,v_bits", [(3, 3), (4, 3), (4, 4), (8, 8)], ids=["k3v3", "k4v3", "k4v4", "q8"])
def test_prefill_tiny(k_bits, v_bits):
    """5 queries at positions 3..7, GQA 2 query heads per KV head, d = 16: one query tile, one key tile
    cut at the last query's position."""
    check_prefill(T=5, H=2, Hkv=1, d=16, pos0=3, k_bits=k_bits, v_bits=v_bits,
                  rng=np.random.default_rng(k_bits * 10 + v_bits))


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_prefill_two_key_tiles_and_heads():
    """66 cached rows (two key tiles, the second cut), 2 KV heads of 2 query heads, d = 32, 3 bits."""
    check_prefill(T=3, H=4, Hkv=2, d=32, pos0=63, k_bits=3, v_bits=3, rng=np.random.default_rng(5))


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_the_emulation_is_the_rotated_reference_up_to_float16():
    """Without its float16 roundings the emulation is attention_rotated_ref, gated: the test's reference
    computes the same attention the decode kernels are checked against."""
    rng = np.random.default_rng(9)
    T, H, Hkv, d, pos0 = 4, 2, 1, 16, 6
    q = rng.standard_normal((T, H, d)).astype(np.float32)
    kv = rng.standard_normal((2, pos0 + T, Hkv, d)).astype(np.float32)
    kc, kn = ref.quantize(kv[0], 3, K_SEED)
    vc, vn = ref.quantize(kv[1], 4, V_SEED)
    gate = np.zeros((T, H, d), np.float32)
    got = emulate(q, kc, kn, vc, vn, pos0, 3, 4, gate)
    want = ref.attention_rotated_ref(q, kc, kn, vc, vn, pos0 + np.arange(T), 3, 4, K_SEED, V_SEED) / 2
    np.testing.assert_allclose(got, want.reshape(T, H * d), rtol=0, atol=3e-3 * np.abs(want).max())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("k_bits,v_bits", [(3, 3), (4, 3), (4, 4), (8, 8)], ids=["k3v3", "k4v3", "k4v4", "q8"])
@pytest.mark.parametrize("T,H,pos0,n_warps", [(1, 16, 0, 4), (113, 16, 799, 4), (300, 24, 3, 4),
                                              (129, 24, 4000, 8)])
def test_prefill_model_shapes(T, H, pos0, n_warps, k_bits, v_bits):
    """The 9B's and 27B's attention (4 KV heads, d = 256) at depths up to 4,129."""
    check_prefill(T=T, H=H, Hkv=4, d=256, pos0=pos0, k_bits=k_bits, v_bits=v_bits,
                  rng=np.random.default_rng(T + pos0), n_warps=n_warps)


@pytest.mark.skipif(SIMULATOR or gpu_available() or not __import__("os").path.exists(
    "/usr/local/cuda/nvvm/libdevice/libdevice.10.bc"), reason="offline PTX check: needs NVVM + libdevice, no GPU")
def test_ptx_offline_uses_mma_and_no_local_memory(monkeypatch):
    """The 27B's coded kernel compiled to sm_90a PTX without a device (as test_flash_attn_mma.py does for the
    float16 one): the tensor-core path is there and the tiles' decode keeps O, S, P in registers."""
    import types as pytypes

    import numba.cuda.cudadrv.nvrtc as nvrtc_mod
    import numba.cuda.cudadrv.nvvm as nvvm_mod
    import numba.cuda.dispatcher as dispatcher_mod
    from numba import types

    from ninfer_numba.kernels.flash_attn import prefill_mma
    libdevice = "/usr/local/cuda/nvvm/libdevice/libdevice.10.bc"
    monkeypatch.setattr(dispatcher_mod, "get_current_device",
                        lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    monkeypatch.setattr(nvrtc_mod.config, "FORCE_CUDA_CC", (9, 0, "a"))
    monkeypatch.setattr(nvvm_mod, "get_libdevice", lambda: libdevice)
    monkeypatch.setattr(nvvm_mod, "open_libdevice", lambda: open(libdevice, "rb").read())
    kernel = prefill_mma._prefill_mma_kernel(24, 4, 256, prefill_mma.N_WARPS, (3, 3))
    u8, u16 = types.Array(types.uint8, 3, "C"), types.Array(types.uint16, 2, "C")
    f32_1d = types.Array(types.float32, 1, "C")
    sig = (types.Array(types.float16, 3, "C"), types.Tuple((u8, u16, f32_1d)),
           types.Tuple((u8, u16, f32_1d, f32_1d)), types.Array(types.int32, 1, "C"),
           types.Array(types.float32, 2, "C"), types.Array(types.float32, 2, "C"))
    ptx_text, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0, "a"), launch_bounds=(128, 2))
    assert ptx_text.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") >= 2 * 8 * 4
    assert "cp.async.cg.shared.global" not in ptx_text          # tiles are decoded, not copied
    assert "ld.local" not in ptx_text and "st.local" not in ptx_text
