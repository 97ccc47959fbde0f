"""qk_norm_rope_store against the NumPy reference (QK-norm, NEOX partial RoPE, f16 cache store).

Tolerances:
- q (float32 out): the kernel sums d squares in float32 (reference: float64 sum) and rotates in float64;
  |Δ| ≤ (d + 16)·2^-24·max|q_ref|, the worst-case float32 error of a length-d sum plus a few roundings.
- k (float16 cache): the float32 value is rounded to f16 once; a value within the float32 error of a
  rounding boundary may round the other way: |Δ| ≤ 2^-11·|k_ref| + (d + 16)·2^-24·max|k_ref|.
- v (float16 cache): data movement, bit-exact against numpy's float32 -> float16 rounding.
- rows of the cache outside [pos0, pos0+T) keep their NaN poison.
"""
import numpy as np
import pytest

from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available
from ninfer_numba.kernels.flash_attn.ref import qk_norm_rope_ref
from ninfer_numba.kernels.flash_attn.rope import qk_norm_rope_store

U32, U16 = 2.0 ** -24, 2.0 ** -11
needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")


def _run_and_check(T, H, Hkv, d, n_rot, pos0, max_seq, q_dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    base, eps = 1e7, 1e-6
    proj = (rng.standard_normal((T, 2 * d * H + 2 * d * Hkv)) * 2).astype(np.float32)
    qw = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    kw = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    d_q = cuda.to_device(np.full((T, H, d), np.nan, q_dtype))
    d_k = cuda.to_device(np.full((Hkv, max_seq, d), np.nan, np.float16))
    d_v = cuda.to_device(np.full((Hkv, max_seq, d), np.nan, np.float16))
    pos0_buf = cuda.to_device(np.array([pos0], np.int32))
    qk_norm_rope_store(cuda.to_device(proj), cuda.to_device(qw), cuda.to_device(kw), pos0_buf, d_q, d_k, d_v,
                       H=H, Hkv=Hkv, n_rot=n_rot, base=base, eps=eps)
    q, k_cache, v_cache = d_q.copy_to_host(), d_k.copy_to_host(), d_v.copy_to_host()
    q_ref, _, k_ref, v_ref = qk_norm_rope_ref(proj, qw, kw, pos0, H, Hkv, d, n_rot, base, eps)

    f32_bound = (d + 16) * U32
    q_ref_c = q_ref.astype(q_dtype).astype(np.float64)
    q_bound = f32_bound * np.abs(q_ref).max() + (U16 * np.abs(q_ref) if q_dtype == np.float16 else 0)
    assert np.all(np.abs(q.astype(np.float64) - q_ref_c) <= q_bound), \
        f"q max|Δ| {np.abs(q - q_ref_c).max():.3e}"
    rows = slice(pos0, pos0 + T)
    k_got = k_cache[:, rows].transpose(1, 0, 2).astype(np.float64)      # [T, Hkv, d]
    k_bound = U16 * np.abs(k_ref) + f32_bound * np.abs(k_ref).max()
    assert np.all(np.abs(k_got - k_ref) <= k_bound), f"k max|Δ| {np.abs(k_got - k_ref).max():.3e}"
    np.testing.assert_array_equal(v_cache[:, rows].transpose(1, 0, 2), v_ref.astype(np.float16))
    outside = np.ones(max_seq, bool)
    outside[rows] = False
    assert np.isnan(k_cache[:, outside]).all() and np.isnan(v_cache[:, outside]).all()


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("T,H,Hkv,d,n_rot,pos0", [
    (1, 4, 1, 32, 8, 0), (7, 4, 2, 48, 16, 5), (3, 2, 2, 48, 48, 1000), (5, 3, 1, 32, 32, 32760)],
    ids=["T1-H4-HKV1-D32", "T7-H4-HKV2-D48", "T3-H2-HKV2-D48-fullrot", "T5-H3-HKV1-D32-pos32760"])
def test_norm_rope_store_tiny(T, H, Hkv, d, n_rot, pos0):
    _run_and_check(T, H, Hkv, d, n_rot, pos0, max_seq=pos0 + T + 3)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_norm_rope_store_f16_q():
    _run_and_check(4, 2, 1, 48, 16, 2, max_seq=9, q_dtype=np.float16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [1, 7, 63, 113, 1023])
@pytest.mark.parametrize("H", [16, 24], ids=["9B", "27B"])
def test_norm_rope_store_full(T, H):
    _run_and_check(T, H, 4, 256, 64, pos0=799, max_seq=799 + T + 5)
    _run_and_check(T, H, 4, 256, 64, pos0=0, max_seq=T)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_norm_rope_store_batched_slots():
    """A batched decode step: row b is one token of its own sequence at position pos[b], stored in the KV
    heads of slot slots[b] of a slab; bit for bit the one-sequence call at that position and slot, and no
    other cache row written."""
    H, Hkv, d, n_rot, max_seq, n_slots = 4, 2, 32, 16, 12, 3
    pos, slots = [3, 0, 10], [1, 2, 0]
    rng = np.random.default_rng(5)
    proj = (rng.standard_normal((len(pos), 2 * d * H + 2 * d * Hkv)) * 2).astype(np.float32)
    qw, kw = [cuda.to_device((1 + 0.2 * rng.standard_normal(d)).astype(np.float32)) for _ in range(2)]
    rope = dict(H=H, Hkv=Hkv, n_rot=n_rot, base=1e7, eps=1e-6)
    slab = lambda: cuda.to_device(np.full((n_slots * Hkv, max_seq, d), np.nan, np.float16))  # noqa: E731
    d_q, d_k, d_v = cuda.to_device(np.full((len(pos), H, d), np.nan, np.float32)), slab(), slab()
    qk_norm_rope_store(cuda.to_device(proj), qw, kw, cuda.to_device(np.array(pos, np.int32)), d_q, d_k, d_v,
                       slots=cuda.to_device(np.array(slots, np.int32)), **rope)
    q, k, v = d_q.copy_to_host(), d_k.copy_to_host(), d_v.copy_to_host()
    for b, (p, s_) in enumerate(zip(pos, slots)):
        one_q = cuda.to_device(np.full((1, H, d), np.nan, np.float32))
        one_k = cuda.to_device(np.full((Hkv, max_seq, d), np.nan, np.float16))
        one_v = cuda.to_device(np.full((Hkv, max_seq, d), np.nan, np.float16))
        qk_norm_rope_store(cuda.to_device(proj[b:b + 1]), qw, kw, cuda.to_device(np.array([p], np.int32)),
                           one_q, one_k, one_v, **rope)
        np.testing.assert_array_equal(q[b], one_q.copy_to_host()[0])
        np.testing.assert_array_equal(k[s_ * Hkv:(s_ + 1) * Hkv], one_k.copy_to_host())   # NaN where unwritten
        np.testing.assert_array_equal(v[s_ * Hkv:(s_ + 1) * Hkv], one_v.copy_to_host())


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("k_bits,v_bits", [(3, 3), (4, 3), (8, 8)], ids=["k3v3", "k4v3", "q8"])
@pytest.mark.parametrize("d", [32, 256])
def test_norm_rope_codes_a_coded_cache(k_bits, v_bits, d):
    """Given a coded cache's roles, the kernel codes the keys and values it would store in float16: the same
    queries, and codes and norms equal to kvq_append's on those float16 rows (the coder is shared: every
    code, every norm bit, though the rope kernel's 64 threads hold d = 256 in registers, shuffles and
    shared memory where kvq_append's 256 hold one coordinate each), at rows pos0..pos0+T-1 only."""
    _check_coded_cache(k_bits, v_bits, d, 64)


@pytest.mark.cudasim
@needs_sim_or_gpu
@pytest.mark.parametrize("threads", [32, 128, 256])
def test_norm_rope_codes_with_any_block_size(threads):
    """The same with blocks of 32 (8 coordinates a thread), 128 and 256 (one each) at d = 256, against the
    float16 cache made with the same block size (the sums of squares run in another order)."""
    _check_coded_cache(3, 3, 256, threads)
    with pytest.raises(ValueError, match="power of two"):
        _check_coded_cache(3, 3, 256, 96)


def _check_coded_cache(k_bits, v_bits, d, threads):
    from ninfer_numba.kernels.kvq.append import KvqTables, kvq_append
    T, H, Hkv, n_rot, pos0, max_seq = (3, 2, 2, 16, 4, 9) if d == 32 else (1, 1, 1, 64, 4, 6)
    rng = np.random.default_rng(8)
    proj = cuda.to_device((rng.standard_normal((T, 2 * d * H + 2 * d * Hkv)) * 2).astype(np.float32))
    qw, kw = [cuda.to_device((1 + 0.2 * rng.standard_normal(d)).astype(np.float32)) for _ in range(2)]
    rope = dict(H=H, Hkv=Hkv, n_rot=n_rot, base=1e7, eps=1e-6, threads=threads)
    pos = cuda.to_device(np.array([pos0], np.int32))
    f16 = [cuda.to_device(np.full((Hkv, max_seq, d), np.nan, np.float16)) for _ in range(2)]
    q = [cuda.to_device(np.zeros((T, H, d), np.float32)) for _ in range(2)]
    qk_norm_rope_store(proj, qw, kw, pos, q[0], *f16, **rope)
    tables = [KvqTables(d, k_bits, 31), KvqTables(d, v_bits, 32)]
    blank = lambda bits: (cuda.to_device(np.full((Hkv, max_seq, d * bits // 8), 0xAB, np.uint8)),  # noqa: E731
                          cuda.to_device(np.full((Hkv, max_seq), 0xCDEF, np.uint16)))
    coded = [blank(tab.bits) for tab in tables]
    qk_norm_rope_store(proj, qw, kw, pos, q[1], *(tab.role(*c) for tab, c in zip(tables, coded)), **rope)
    np.testing.assert_array_equal(q[0].copy_to_host(), q[1].copy_to_host())
    for cache, tab, (codes, norms) in zip(f16, tables, coded):
        rows = np.ascontiguousarray(cache.copy_to_host()[:, pos0:pos0 + T].transpose(1, 0, 2), np.float32)
        want = blank(tab.bits)
        kvq_append(cuda.to_device(rows), tab, *want, pos)
        np.testing.assert_array_equal(codes.copy_to_host(), want[0].copy_to_host())
        np.testing.assert_array_equal(norms.copy_to_host(), want[1].copy_to_host())
        assert (codes.copy_to_host()[:, pos0:pos0 + T] != 0xAB).any()
    with pytest.raises(ValueError, match="one sequence"):
        qk_norm_rope_store(proj, qw, kw, cuda.to_device(np.arange(T, dtype=np.int32)), q[1],
                           *(tab.role(*c) for tab, c in zip(tables, coded)),
                           slots=cuda.to_device(np.arange(T, dtype=np.int32)), **rope)
