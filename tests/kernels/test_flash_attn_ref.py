"""CPU tests of the attention NumPy reference (fast, no numba).

Tolerances: float64 math compared with float64 math is held to 1e-12 relative; results that pass through a
float32 output are held to 4 float32 ulps of the largest value (|Δ| ≤ 4·2^-24·max|ref|).
"""
import numpy as np
import pytest

from ninfer_numba.kernels.flash_attn.ref import (
    attention_ref, attn_mixer_ref, rmsnorm_ref, rope_neox_ref, split_proj_ref, split_q_gate_ref,
)

U32 = 2.0 ** -24


def _close_f32(out, ref, ulps=4):
    bound = ulps * U32 * np.abs(ref).max()
    err = np.abs(np.asarray(out, np.float64) - np.asarray(ref, np.float64)).max()
    assert err <= bound, f"max|Δ| {err:.3e} > {bound:.3e}"


def test_rmsnorm_matches_float64_definition():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 3, 48)).astype(np.float32) * 3
    w = rng.standard_normal(48).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    _close_f32(rmsnorm_ref(x, w, 1e-6), want, ulps=8)


@pytest.mark.parametrize("d,n_rot", [(32, 8), (48, 16), (256, 64), (16, 16)], ids=lambda v: str(v))
def test_rope_equals_complex_rotation(d, n_rot):
    rng = np.random.default_rng(1)
    T, nh, base = 9, 3, 1e7
    x = rng.standard_normal((T, nh, d)).astype(np.float32)
    pos = np.array([0, 1, 2, 5, 77, 799, 4096, 32767, 262143])
    half = n_rot // 2
    z = x[..., :half].astype(np.float64) + 1j * x[..., half:n_rot].astype(np.float64)
    theta = pos[:, None] * base ** (-np.arange(half) * 2.0 / n_rot)
    z = z * np.exp(1j * theta)[:, None, :]
    want = x.astype(np.float64).copy()
    want[..., :half], want[..., half:n_rot] = z.real, z.imag
    out = rope_neox_ref(x, pos, n_rot, base)
    _close_f32(out, want, ulps=2)
    np.testing.assert_array_equal(out[..., n_rot:], x[..., n_rot:])   # unrotated dims are copied exactly


def test_rope_position_zero_is_identity():
    x = np.random.default_rng(2).standard_normal((1, 2, 32)).astype(np.float32)
    np.testing.assert_array_equal(rope_neox_ref(x, np.array([0]), 32, 1e4), x)


def test_split_q_gate_layout():
    H, d = 3, 4
    proj = np.arange(2 * d * H, dtype=np.float32)[None]
    q, g = split_q_gate_ref(proj, H, d)
    for h in range(H):
        np.testing.assert_array_equal(q[0, h], np.arange(2 * d * h, 2 * d * h + d))
        np.testing.assert_array_equal(g[0, h], np.arange(2 * d * h + d, 2 * d * (h + 1)))
    full = np.arange(2 * d * H + 2 * d * 2, dtype=np.float32)[None]
    _, _, k, v = split_proj_ref(full, H, 2, d)
    np.testing.assert_array_equal(k.ravel(), np.arange(2 * d * H, 2 * d * H + 2 * d))
    np.testing.assert_array_equal(v.ravel(), np.arange(2 * d * H + 2 * d, 2 * d * H + 4 * d))


def _attention_loops(q, k, v, q_pos):
    """Independent formulation: explicit loops over (t, h), kv head from integer division."""
    T, H, d = q.shape
    group = H // k.shape[1]
    o = np.zeros((T, H, d))
    for t in range(T):
        for h in range(H):
            kv = h // group
            s = np.array([q[t, h].astype(np.float64) @ k[j, kv] / np.sqrt(d) for j in range(q_pos[t] + 1)])
            p = np.exp(s - s.max())
            o[t, h] = (p[:, None] * v[:q_pos[t] + 1, kv]).sum(0) / p.sum()
    return o


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 1), (8, 1), (8, 2), (6, 1), (24, 4)],
                         ids=lambda v: str(v))
def test_attention_ref_matches_loops(H, Hkv):
    rng = np.random.default_rng(3)
    T, L, d = 5, 11, 48
    q = rng.standard_normal((T, H, d)).astype(np.float32)
    k = rng.standard_normal((L, Hkv, d)).astype(np.float32)
    v = rng.standard_normal((L, Hkv, d)).astype(np.float32)
    q_pos = np.array([0, 3, 4, 9, 10])
    _close_f32(attention_ref(q, k, v, q_pos), _attention_loops(q, k, v, q_pos))


def _mixer_inputs(rng, T, H, Hkv, d):
    proj = rng.standard_normal((T, 2 * d * H + 2 * d * Hkv)).astype(np.float32)
    return proj, 1 + 0.1 * rng.standard_normal(d).astype(np.float32), \
        1 + 0.1 * rng.standard_normal(d).astype(np.float32)


@pytest.mark.parametrize("H,Hkv,d,n_rot", [(4, 4, 32, 8), (4, 1, 48, 16), (8, 1, 32, 32), (6, 1, 48, 16),
                                           (8, 2, 64, 16)], ids=lambda v: str(v))
def test_mixer_chunked_and_token_by_token_agree(H, Hkv, d, n_rot):
    """Prefill in one call == prefill in two chunks == token by token through the cache."""
    rng = np.random.default_rng(4)
    T, max_seq, base, eps = 13, 20, 1e7, 1e-6
    proj, qw, kw = _mixer_inputs(rng, T, H, Hkv, d)

    def fresh():
        return np.full((max_seq, Hkv, d), np.nan, np.float32), np.full((max_seq, Hkv, d), np.nan, np.float32)

    args = (H, Hkv, d, n_rot, base, eps)
    kc, vc = fresh()
    one = attn_mixer_ref(proj, qw, kw, kc, vc, 0, *args)
    kc2, vc2 = fresh()
    two = np.concatenate([attn_mixer_ref(proj[:6], qw, kw, kc2, vc2, 0, *args),
                          attn_mixer_ref(proj[6:], qw, kw, kc2, vc2, 6, *args)])
    kc3, vc3 = fresh()
    tok = np.concatenate([attn_mixer_ref(proj[t:t + 1], qw, kw, kc3, vc3, t, *args) for t in range(T)])
    assert one.shape == (T, H * d)
    _close_f32(two, one)
    _close_f32(tok, one)
    np.testing.assert_array_equal(kc[:T], kc3[:T])
    assert np.isnan(kc[T:]).all()                          # rows past the written positions are untouched


def test_mixer_first_token_is_gated_value():
    """With one key the softmax is 1: the output is v (broadcast over the GQA group) times σ(gate)."""
    rng = np.random.default_rng(5)
    H, Hkv, d = 4, 2, 32
    proj, qw, kw = _mixer_inputs(rng, 1, H, Hkv, d)
    kc, vc = np.zeros((4, Hkv, d), np.float32), np.zeros((4, Hkv, d), np.float32)
    out = attn_mixer_ref(proj, qw, kw, kc, vc, 0, H, Hkv, d, 8, 1e7, 1e-6)
    _, gate, _, v = split_proj_ref(proj, H, Hkv, d)
    want = v[0][np.arange(H) // 2] / (1 + np.exp(-gate[0].astype(np.float64)))
    _close_f32(out[0].reshape(H, d), want)


def test_mixer_rejects_overflowing_positions():
    proj = np.zeros((3, 2 * 32 + 2 * 32), np.float32)
    kc = np.zeros((4, 1, 32), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        attn_mixer_ref(proj, np.ones(32), np.ones(32), kc, kc.copy(), 2, 1, 1, 32, 8, 1e4, 1e-6)


def test_mixer_f16_store_rounds_the_cache_and_moves_the_output_by_f16_error():
    rng = np.random.default_rng(6)
    H, Hkv, d, T = 4, 2, 32, 5
    proj, qw, kw = _mixer_inputs(rng, T, H, Hkv, d)
    caches = [np.zeros((T, Hkv, d), np.float32) for _ in range(4)]
    exact = attn_mixer_ref(proj, qw, kw, caches[0], caches[1], 0, H, Hkv, d, 8, 1e7, 1e-6)
    half = attn_mixer_ref(proj, qw, kw, caches[2], caches[3], 0, H, Hkv, d, 8, 1e7, 1e-6, store_dtype=np.float16)
    np.testing.assert_array_equal(caches[2], caches[0].astype(np.float16).astype(np.float32))
    rel = np.linalg.norm(half - exact) / np.linalg.norm(exact)
    assert 1e-5 < rel < 2e-3
