"""attention_prefill_mma (fp16 tensor cores) and its intrinsics (mma_f16.py) against NumPy.

The intrinsic tests are exact: mma on integer-valued f16 operands (every product and partial sum is an
integer below 2^24, so float32 accumulation is exact), ldmatrix is data movement, and pack_f16x2 must
round exactly as numpy's float32 -> float16 (round to nearest even).

The kernel is compared with a float64 reference fed the same f16 cache. Its tolerance is derived per
output element from what the kernel rounds (module docstring of prefill_mma.py), with u = 2^-11 the f16
unit roundoff and w_j the reference softmax weights of the row:

    |out − ref| ≤ σ(gate)·[ρ·Σ_j w_j|v_j| + L·2^-25·max|v| / l] + 8·2^-24·|ref|
    ρ = (e^{2·E_s} − 1) + u + (L/16 + 32)·2^-23 + 2·4·2^-22·(1 + max|s|·log2 e)

- E_s bounds the logit error: scale·max_j Σ_i (|q_i − f16(q_i)|·|k_ji| + d·2^-23·|f16(q_i)|·|k_ji|)
  (query rounding plus float32 accumulation of the d products; it shifts the weights by ≤ e^{2E_s} − 1);
- u: P is rounded to f16 before P·V (the row sums l use the unrounded P);
- (L/16 + 32)·2^-23: float32 accumulation of P·V over L/16 mma steps and the row-sum chain;
- 4·2^-22·(1 + |x|): ex2.approx and the rounding of x = s·log2(e)/√d, for P and for l;
- L·2^-25·max|v|/l: P values below the f16 normal range are rounded with absolute error ≤ 2^-25
  (relative to the running max, so ≤ 1 after rescaling), l ≥ 1 being the reference row sum;
- 8·2^-24·|ref|: the float32 σ(gate) and the final multiply.
Most cases feed f16-representable queries (E_s is then only the accumulation term); the raw-float32
and float16 query cases check the conversion path. Cache rows at and past pos0+T hold NaN (reading one
fails the test); the output starts as NaN.
"""
import math
import os

import numpy as np
import pytest

from attn_cases import attention_inputs
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels import ptx
from ninfer_numba.kernels.flash_attn import mma_f16, prefill_mma
from ninfer_numba.kernels.flash_attn.prefill_mma import attention_prefill_mma
from ninfer_numba.kernels.flash_attn.ref import attention_ref, gate_ref

needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
U16 = 2.0 ** -11
LOG2E = 1.0 / math.log(2.0)


# ---------------------------------------------------------------- reference and bound (float64) -------

def _reference_and_bound(q, k_cache, v_cache, pos0, gate):
    """(o ⊙ σ(gate), error bound), both [T, H·d] float64; per head with BLAS (T up to 4096).

    q [T, H, d], k_cache / v_cache [Hkv, ≥ pos0+T, d] float16, gate [T, H, d]."""
    T, H, d = q.shape
    G = H // k_cache.shape[0]
    L = pos0 + T
    scale = 1.0 / math.sqrt(d)
    q64 = np.asarray(q, np.float64)
    q16 = np.asarray(q).astype(np.float16).astype(np.float64)     # what the kernel multiplies
    dq = np.abs(q64 - q16)
    visible = np.arange(L)[None, :] <= (pos0 + np.arange(T))[:, None]     # [T, L]
    sig = 1.0 / (1.0 + np.exp(-np.asarray(gate, np.float64)))
    ref = np.empty((T, H, d))
    bound = np.empty((T, H, d))
    for h in range(H):
        k = k_cache[h // G, :L].astype(np.float64)
        v = v_cache[h // G, :L].astype(np.float64)
        s = np.where(visible, (q64[:, h] @ k.T) * scale, -np.inf)          # [T, L]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        l = p.sum(axis=1, keepdims=True)
        w = p / l
        abs_k = np.abs(k)
        e_s = scale * np.where(visible, dq[:, h] @ abs_k.T + d * 2.0 ** -23 * (np.abs(q16[:, h]) @ abs_k.T),
                               0.0).max(axis=1)
        s_max = np.where(visible, np.abs(s), 0.0).max(axis=1)
        rho = (np.expm1(2 * e_s) + U16 + (L / 16 + 32) * 2.0 ** -23
               + 2 * 4 * 2.0 ** -22 * (1 + s_max * LOG2E))
        o = w @ v
        ref[:, h] = o * sig[:, h]
        bound[:, h] = (sig[:, h] * (rho[:, None] * (w @ np.abs(v)) + L * 2.0 ** -25 * np.abs(v).max() / l)
                       + 8 * 2.0 ** -24 * np.abs(ref[:, h]))
    return ref.reshape(T, H * d), bound.reshape(T, H * d)


def _case(T, H, Hkv, d, pos0, q_mode="f16-exact", seed=0):
    """Random inputs with NaN past the valid cache rows. q_mode: f16-exact (float32 holding f16 values),
    f32 (raw float32), f16 (a float16 array)."""
    q, k_cache, v_cache, proj = attention_inputs(np.random.default_rng(seed), T, H, Hkv, d, pos0 + T, pos0 + T + 9)
    if q_mode == "f16-exact":
        q = q.astype(np.float16).astype(np.float32)
    elif q_mode == "f16":
        q = q.astype(np.float16)
    return q, k_cache, v_cache, proj


def _check(T, H, Hkv, d, pos0, q_mode="f16-exact", seed=0):
    q, k_cache, v_cache, proj = _case(T, H, Hkv, d, pos0, q_mode, seed)
    d_out = cuda.to_device(np.full((T, H * d), np.nan, np.float32))
    attention_prefill_mma(cuda.to_device(q), cuda.to_device(k_cache), cuda.to_device(v_cache),
                          cuda.to_device(np.array([pos0], np.int32)), cuda.to_device(proj), d_out)
    out = d_out.copy_to_host()
    gate = proj[:, :2 * d * H].reshape(T, H, 2, d)[:, :, 1]
    ref, bound = _reference_and_bound(q, k_cache, v_cache, pos0, gate)
    err = np.abs(out - ref)
    bad = ~(err <= bound)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} elements out of bound; first at "
                           f"{np.argwhere(bad)[0]}; max|Δ| {np.nanmax(err):.3e}, max bound {bound.max():.3e}, "
                           f"max|ref| {np.abs(ref).max():.3e}")


def _ids(cases):
    return [f"T{T}-H{H}-HKV{Hkv}-D{d}-pos{p}" + (f"-{m}" if m != "f16-exact" else "")
            for T, H, Hkv, d, p, m in cases]


# ---------------------------------------------------------------- CPU: host logic and the reference ---

def test_reference_and_bound_matches_attention_ref():
    """The per-head float64 reference used here agrees with the package reference."""
    T, H, Hkv, d, pos0 = 9, 6, 2, 32, 5
    q, k_cache, v_cache, proj = _case(T, H, Hkv, d, pos0, "f32")
    gate = proj[:, :2 * d * H].reshape(T, H, 2, d)[:, :, 1]
    ref, bound = _reference_and_bound(q, k_cache, v_cache, pos0, gate)
    k = k_cache[:, :pos0 + T].transpose(1, 0, 2).astype(np.float32)
    v = v_cache[:, :pos0 + T].transpose(1, 0, 2).astype(np.float32)
    pkg = gate_ref(attention_ref(q, k, v, pos0 + np.arange(T)), gate)
    np.testing.assert_allclose(ref, pkg, rtol=1e-5, atol=1e-6)      # pkg is rounded to float32
    assert np.all(bound > 0) and np.all(np.isfinite(bound))


def test_host_shape_logic():
    assert prefill_mma.supports_shape(16, 4, 256) and prefill_mma.supports_shape(24, 4, 256)
    assert prefill_mma.supports_shape(6, 1, 48) and prefill_mma.supports_shape(2, 2, 16)
    assert not prefill_mma.supports_shape(16, 4, 40)          # d % 16
    assert not prefill_mma.supports_shape(16, 4, 272)         # d > 256: O would not fit the registers
    assert not prefill_mma.supports_shape(6, 4, 64)           # H % Hkv
    assert prefill_mma.launch_grid(1, 16) == (1, 16)
    assert prefill_mma.launch_grid(64, 24) == (1, 24)
    assert prefill_mma.launch_grid(65, 24) == (2, 24)
    assert prefill_mma.launch_grid(129, 16, n_warps=8) == (2, 16)
    # Q, K, V tiles at d = 256: two 4-warp blocks (one 8-warp block) must fit the H200's 227 KiB
    # of shared memory per SM, plus 1 KiB reserved per block
    assert prefill_mma.smem_bytes(256) == (64 + 2 * 64) * (128 + 4) * 4
    assert 2 * (prefill_mma.smem_bytes(256) + 1024) <= 227 * 1024
    assert prefill_mma.smem_bytes(256, n_warps=8) + 1024 <= 227 * 1024
    # the O staging tile [16·n_warps, d + 4] float32 reuses the same space
    for n_warps in (4, 8):
        for d in (16, 48, 64, 128, 256):
            assert 16 * n_warps * (d + 4) * 4 <= prefill_mma.smem_bytes(d, n_warps)


def test_unsupported_shape_raises_before_launch():
    q = np.zeros((3, 4, 40), np.float32)
    cache = np.zeros((2, 8, 40), np.float16)
    with pytest.raises(ValueError, match="unsupported mma prefill shape"):
        attention_prefill_mma(q, cache, cache, np.zeros(1, np.int32), np.zeros((3, 480), np.float32),
                              np.zeros((3, 160), np.float32))


LIBDEVICE = "/usr/local/cuda/nvvm/libdevice/libdevice.10.bc"


@pytest.mark.skipif(SIMULATOR or gpu_available() or not os.path.exists(LIBDEVICE),
                    reason="offline PTX check: needs NVVM + libdevice and no GPU (a GPU runs the real tests)")
def test_ptx_offline_uses_mma_and_no_local_memory(monkeypatch):
    """Compile the 9B kernel to sm_90a PTX without a device (reference/numba-cuda.md §7, test-only
    patches of numba internals): the tensor-core path is there and O, S, P stay in registers."""
    import types as pytypes

    import numba.cuda.cudadrv.nvrtc as nvrtc_mod
    import numba.cuda.cudadrv.nvvm as nvvm_mod
    import numba.cuda.dispatcher as dispatcher_mod
    from numba import types

    monkeypatch.setattr(dispatcher_mod, "get_current_device",
                        lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    monkeypatch.setattr(nvrtc_mod.config, "FORCE_CUDA_CC", (9, 0, "a"))
    monkeypatch.setattr(nvvm_mod, "get_libdevice", lambda: LIBDEVICE)
    monkeypatch.setattr(nvvm_mod, "open_libdevice", lambda: open(LIBDEVICE, "rb").read())
    kernel = prefill_mma._prefill_mma_kernel(16, 4, 256, prefill_mma.N_WARPS)
    f16_3d = types.Array(types.float16, 3, "C")
    sig = (types.Array(types.float32, 3, "C"), f16_3d, f16_3d, types.Array(types.int32, 1, "C"),
           types.Array(types.float32, 2, "C"), types.Array(types.float32, 2, "C"))
    ptx_text, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0, "a"), launch_bounds=(128, 2))
    assert ptx_text.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") >= 2 * 8 * 4
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx_text
    assert "cp.async.cg.shared.global" in ptx_text
    assert "ld.local" not in ptx_text and "st.local" not in ptx_text


# ---------------------------------------------------------------- intrinsics (simulator twins or PTX) -

@cuda.jit
def _mma_kernel(a_words, b_words, c, d):
    """One warp: a_words [32, 4], b_words [32, 2] uint32 fragments, c / d [32, 4] float32."""
    lane = cuda.threadIdx.x
    d[lane, 0], d[lane, 1], d[lane, 2], d[lane, 3] = mma_f16.mma_f16_16816(
        a_words[lane, 0], a_words[lane, 1], a_words[lane, 2], a_words[lane, 3],
        b_words[lane, 0], b_words[lane, 1], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])


def _pairs(m, rows, cols):
    """uint32 words packing (m[rows, cols], m[rows, cols+1]) as f16, low half first."""
    lo = m[rows, cols].astype(np.float16).view(np.uint16).astype(np.uint32)
    hi = m[rows, cols + 1].astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo | (hi << 16)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_mma_f16_16816_layout_exact():
    rng = np.random.default_rng(3)
    a = rng.integers(-8, 9, (16, 16)).astype(np.float64)
    b = rng.integers(-8, 9, (16, 8)).astype(np.float64)
    c = rng.integers(-100, 101, (16, 8)).astype(np.float64)
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    a_words = np.stack([_pairs(a, g, 2 * t), _pairs(a, g + 8, 2 * t),
                        _pairs(a, g, 2 * t + 8), _pairs(a, g + 8, 2 * t + 8)], axis=1)
    bt = b.T                                                    # B column g is row g of Bᵀ
    b_words = np.stack([_pairs(bt, g, 2 * t), _pairs(bt, g, 2 * t + 8)], axis=1)
    c_frag = np.stack([c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]], 1)
    d_out = cuda.to_device(np.full((32, 4), np.nan, np.float32))
    _mma_kernel[1, 32](cuda.to_device(a_words), cuda.to_device(b_words),
                       cuda.to_device(c_frag.astype(np.float32)), d_out)
    dm = a @ b + c
    want = np.stack([dm[g, 2 * t], dm[g, 2 * t + 1], dm[g + 8, 2 * t], dm[g + 8, 2 * t + 1]], 1)
    np.testing.assert_array_equal(d_out.copy_to_host(), want.astype(np.float32))


@cuda.jit
def _ldmatrix_kernel(src, row_word, plain, trans):
    """src [n] uint32 copied to shared memory; lane l addresses shared word row_word[l]."""
    s = cuda.shared.array(1024, np.uint32, alignment=16)
    lane = cuda.threadIdx.x
    for i in range(lane, src.size, 32):
        s[i] = src[i]
    cuda.syncthreads()
    plain[lane, 0], plain[lane, 1], plain[lane, 2], plain[lane, 3] = ptx.ldmatrix_x4(s, row_word[lane])
    trans[lane, 0], trans[lane, 1], trans[lane, 2], trans[lane, 3] = ptx.ldmatrix_x4_trans(
        s, row_word[lane])


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_ldmatrix_x4_plain_and_trans():
    rng = np.random.default_rng(4)
    src = rng.integers(0, 2**32, 1024, dtype=np.uint64).astype(np.uint32)
    row_word = rng.choice(1024 // 4, 32, replace=False).astype(np.int32) * 4     # 16-byte aligned rows
    plain = cuda.to_device(np.zeros((32, 4), np.uint32))
    trans = cuda.to_device(np.zeros((32, 4), np.uint32))
    _ldmatrix_kernel[1, 32](cuda.to_device(src), cuda.to_device(row_word), plain, trans)
    halves = src.view(np.uint16)
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    want_plain = np.zeros((32, 4), np.uint32)
    want_trans = np.zeros((32, 4), np.uint32)
    for m in range(4):
        rows = np.stack([halves[2 * row_word[8 * m + r]:2 * row_word[8 * m + r] + 8] for r in range(8)])
        rows = rows.astype(np.uint32)                            # [8 rows, 8 f16 columns] of matrix m
        want_plain[:, m] = rows[g, 2 * t] | (rows[g, 2 * t + 1] << 16)
        want_trans[:, m] = rows[2 * t, g] | (rows[2 * t + 1, g] << 16)
    np.testing.assert_array_equal(plain.copy_to_host(), want_plain)
    np.testing.assert_array_equal(trans.copy_to_host(), want_trans)


@cuda.jit
def _pack_kernel(lo, hi, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = mma_f16.pack_f16x2(lo[i], hi[i])


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_pack_f16x2_rounds_like_numpy():
    rng = np.random.default_rng(5)
    n = 70
    lo = (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 5, n)).astype(np.float32)
    hi = (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 5, n)).astype(np.float32)
    lo[:4] = [0.0, -0.0, 1.0 + 2.0 ** -11, 70000.0]              # signed zero, a tie, overflow to inf
    out = cuda.to_device(np.zeros(n, np.uint32))
    _pack_kernel[1, 96](cuda.to_device(lo), cuda.to_device(hi), out)
    with np.errstate(over="ignore"):
        want = (lo.astype(np.float16).view(np.uint16).astype(np.uint32)
                | (hi.astype(np.float16).view(np.uint16).astype(np.uint32) << 16))
    np.testing.assert_array_equal(out.copy_to_host(), want)


# ---------------------------------------------------------------- the kernel --------------------------

# simulator: ~2.5 s per 64-query tile x head x key tile at d = 16-32, so tiny shapes only
SIM_CASES = [(7, 2, 1, 16, 0, "f16-exact"), (1, 2, 2, 16, 70, "f32"), (66, 2, 1, 16, 0, "f16-exact"),
             (66, 2, 1, 16, 70, "f16-exact"), (5, 2, 2, 32, 3, "f16"), (9, 4, 2, 48, 30, "f32")]


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("T,H,Hkv,d,pos0,q_mode", SIM_CASES, ids=_ids(SIM_CASES))
def test_prefill_mma_tiny(T, H, Hkv, d, pos0, q_mode):
    _check(T, H, Hkv, d, pos0, q_mode)


GPU_SMALL = [(1, 4, 4, 64, 0, "f16-exact"), (7, 4, 1, 64, 3, "f32"), (63, 8, 2, 128, 0, "f16-exact"),
             (113, 6, 1, 128, 799, "f16-exact"), (113, 12, 2, 256, 3, "f32"), (7, 24, 4, 256, 799, "f16"),
             (63, 4, 4, 256, 799, "f16-exact"), (1, 6, 1, 256, 3, "f16-exact"), (113, 4, 1, 48, 0, "f32"),
             (64, 6, 1, 64, 0, "f16-exact"), (129, 4, 1, 256, 63, "f16-exact")]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T,H,Hkv,d,pos0,q_mode", GPU_SMALL, ids=_ids(GPU_SMALL))
def test_prefill_mma_small(T, H, Hkv, d, pos0, q_mode):
    _check(T, H, Hkv, d, pos0, q_mode)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [1, 7, 63, 113, 1023])
@pytest.mark.parametrize("pos0", [0, 3, 799])
@pytest.mark.parametrize("H", [16, 24], ids=["9B", "27B"])
def test_prefill_mma_full(H, pos0, T):
    _check(T, H, 4, 256, pos0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("q_mode", ["f16-exact", "f32"])
def test_prefill_mma_9b_long(q_mode):
    _check(4096, 16, 4, 256, 0, q_mode)
