"""CPU tests of the Gated DeltaNet NumPy reference (ninfer_numba/kernels/gdn/ref.py).

The references are checked against independent direct formulations (scalar loops written from
qwen35-format.md §5 / gdn-chunked.md), the chunked form against the recurrence, and every stateful piece
for "split the sequence, carry the state" == "one pass".
"""
import subprocess
import sys

import numpy as np
import pytest

from ninfer_numba.kernels.gdn import ref

# The two recurrence forms run in float64 and differ only in summation order and in the triangular solve;
# on these inputs they agree to ~1e-14 relative. 1e-10 of the output scale leaves room for the growth of
# (I + A)^-1 with beta near 1 and no decay, without hiding a wrong term (those show up at >= 1e-3).
FORM_RTOL = 1e-10

DECAYS = {"strong": (0.5, 4.0), "weak": (0.0, 0.02), "mixed": (0.0, 2.0)}   # range of -g
BETAS = {"b0": (0.0, 1e-3), "b1": (0.999, 1.0), "bmix": (0.0, 1.0)}


def make_qkv(rng, T, Hk, Hv, S, decay="mixed", beta="bmix", Dv=None):
    """Random inputs in float64: unit-norm q, k (as the mixer gives), state of unit scale."""
    Dv = S if Dv is None else Dv
    q = ref.l2norm_ref(rng.standard_normal((T, Hk, S)), 1e-6)
    k = ref.l2norm_ref(rng.standard_normal((T, Hk, S)), 1e-6)
    v = rng.standard_normal((T, Hv, Dv))
    lo, hi = BETAS[beta]
    b = rng.uniform(lo, hi, (T, Hv))
    glo, ghi = DECAYS[decay]
    g = -rng.uniform(glo, ghi, (T, Hv))
    state = rng.standard_normal((Hv, S, Dv))
    return q, k, v, b, g, state


def assert_close(out, want, rtol_of_scale, what):
    """|out - want| <= rtol_of_scale * max|want| (plus a tiny floor for an all-zero reference)."""
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(out - want)))
    assert err <= rtol_of_scale * scale, f"{what}: max|err| {err:.3e} > {rtol_of_scale:.1e} * {scale:.3e}"


def recurrent_direct(q, k, v, b, g, state):
    """gdn-chunked.md's first form, one head at a time:
    S = a (I - b k k^T) S + b k v^T, o = S^T q / sqrt(d)."""
    T, Hv, _ = v.shape
    Hk, S = q.shape[1], q.shape[2]
    M = state.copy()
    o = np.zeros(v.shape)
    for j in range(Hv):
        kh = j % Hk
        for t in range(T):
            kt = k[t, kh][:, None]
            M[j] = (np.exp(g[t, j]) * (np.eye(S) - b[t, j] * kt @ kt.T) @ M[j]
                    + b[t, j] * kt @ v[t, j][None, :])
            o[t, j] = M[j].T @ q[t, kh] / np.sqrt(S)
    return o, M


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4), (1, 3)], ids=["Hv=Hk", "Hv=2Hk", "Hv=3Hk"])
def test_recurrent_matches_direct_form(Hk, Hv):
    rng = np.random.default_rng(1)
    q, k, v, b, g, st = make_qkv(rng, 9, Hk, Hv, 16)
    o, s = ref.gdn_recurrent_ref(q, k, v, b, g, st)
    o2, s2 = recurrent_direct(q, k, v, b, g, st)
    assert_close(o, o2, 1e-12, "o")
    assert_close(s, s2, 1e-12, "state")


@pytest.mark.parametrize("S", [16, 32], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4), (2, 6)], ids=["Hv=Hk", "Hv=2Hk", "Hv=3Hk"])
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130], ids=lambda t: f"T{t}")
def test_chunked_matches_recurrent(T, Hk, Hv, S):
    rng = np.random.default_rng(T * 100 + Hv * 10 + S)
    args = make_qkv(rng, T, Hk, Hv, S)
    o_r, s_r = ref.gdn_recurrent_ref(*args)
    o_c, s_c = ref.gdn_chunked_ref(*args)
    assert_close(o_c, o_r, FORM_RTOL, "o")
    assert_close(s_c, s_r, FORM_RTOL, "state")


@pytest.mark.parametrize("beta", list(BETAS))
@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("T", [63, 130], ids=lambda t: f"T{t}")
def test_chunked_matches_recurrent_regimes(T, decay, beta):
    rng = np.random.default_rng(7)
    args = make_qkv(rng, T, 2, 4, 16, decay=decay, beta=beta)
    o_r, s_r = ref.gdn_recurrent_ref(*args)
    for chunk in (64, 16, 7):
        o_c, s_c = ref.gdn_chunked_ref(*args, chunk=chunk)
        assert_close(o_c, o_r, FORM_RTOL, f"o chunk={chunk}")
        assert_close(s_c, s_r, FORM_RTOL, f"state chunk={chunk}")


def test_chunked_f16_operands_round_at_the_kernels_places():
    """f16_operands: the float16 roundings of the GPU prefill (q, k, W, P, h, V'): the result moves by about
    the float16 unit roundoff, not more, and rounding q, k beforehand changes nothing (they are rounded
    once); the default stays float64."""
    rng = np.random.default_rng(9)
    q, k, v, b, g, state = make_qkv(rng, 130, 2, 4, 32)
    o, s = ref.gdn_chunked_ref(q, k, v, b, g, state)
    o16, s16 = ref.gdn_chunked_ref(q, k, v, b, g, state, f16_operands=True)
    for out, want in ((o16, o), (s16, s)):
        rel = np.linalg.norm(out - want) / np.linalg.norm(want)
        assert 2.0 ** -16 < rel < 4 * 2.0 ** -11, rel
    q16, k16 = (x.astype(np.float16).astype(np.float64) for x in (q, k))
    o16b, s16b = ref.gdn_chunked_ref(q16, k16, v, b, g, state, f16_operands=True)
    assert np.array_equal(o16b, o16) and np.array_equal(s16b, s16)


def test_chunked_key_dim_differs_from_value_dim():
    rng = np.random.default_rng(3)
    args = make_qkv(rng, 70, 2, 4, 16, Dv=24)
    o_r, s_r = ref.gdn_recurrent_ref(*args)
    o_c, s_c = ref.gdn_chunked_ref(*args)
    assert o_c.shape == (70, 4, 24) and s_c.shape == (4, 16, 24)
    assert_close(o_c, o_r, FORM_RTOL, "o")
    assert_close(s_c, s_r, FORM_RTOL, "state")


def test_float32_in_float32_out():
    rng = np.random.default_rng(4)
    args = [a.astype(np.float32) for a in make_qkv(rng, 20, 2, 4, 16)]
    o, s = ref.gdn_chunked_ref(*args)
    o64, s64 = ref.gdn_chunked_ref(*[a.astype(np.float64) for a in args])
    assert o.dtype == np.float32 and s.dtype == np.float32 and o64.dtype == np.float64
    # float64 computation rounded once to float32: within one float32 ulp
    assert_close(o, o64, 2.0 ** -23, "o")


@pytest.mark.parametrize("split", [1, 40, 64, 99], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("fn", ["recurrent", "chunked"])
def test_recurrence_split_carries_state(fn, split):
    f = ref.gdn_recurrent_ref if fn == "recurrent" else ref.gdn_chunked_ref
    rng = np.random.default_rng(5)
    q, k, v, b, g, st = make_qkv(rng, 130, 2, 4, 16)
    o_all, s_all = f(q, k, v, b, g, st)
    o1, s1 = f(q[:split], k[:split], v[:split], b[:split], g[:split], st)
    o2, s2 = f(q[split:], k[split:], v[split:], b[split:], g[split:], s1)
    assert_close(np.concatenate([o1, o2]), o_all, FORM_RTOL, "o")
    assert_close(s2, s_all, FORM_RTOL, "state")


def conv_direct(x, w, state):
    T, C = x.shape
    K = w.shape[1]
    y = np.zeros((T, C))
    for t in range(T):
        for c in range(C):
            for kk in range(K):
                src = t - K + 1 + kk                      # index into x; negative reads the carried state
                val = x[src, c] if src >= 0 else state[K - 1 + src, c]
                y[t, c] += w[c, kk] * val
    return y


@pytest.mark.parametrize("T,C,K", [(1, 5, 4), (3, 7, 4), (13, 6, 4), (9, 3, 3), (4, 5, 1)],
                         ids=lambda p: str(p))
def test_conv_matches_direct_loop(T, C, K):
    rng = np.random.default_rng(T * C * K)
    x, w, st = rng.standard_normal((T, C)), rng.standard_normal((C, K)), rng.standard_normal((K - 1, C))
    y, new = ref.causal_conv1d_ref(x, w, st)
    np.testing.assert_allclose(y, conv_direct(x, w, st), rtol=1e-12, atol=1e-12)
    full = np.concatenate([st, x])
    np.testing.assert_array_equal(new, full[full.shape[0] - (K - 1):])   # data movement: exact


@pytest.mark.parametrize("split", [1, 2, 5, 11])
def test_conv_split_carries_state(split):
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((12, 9)), rng.standard_normal((9, 4))
    st = np.zeros((3, 9))
    y_all, s_all = ref.causal_conv1d_ref(x, w, st)
    y1, s1 = ref.causal_conv1d_ref(x[:split], w, st)
    y2, s2 = ref.causal_conv1d_ref(x[split:], w, s1)
    np.testing.assert_allclose(np.concatenate([y1, y2]), y_all, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(s2, s_all)


def test_gates_formula():
    br = np.array([[-30.0, 0.0, 3.0], [50.0, -2.0, 0.5]])
    ar = np.array([[-30.0, 0.0, 19.5], [25.0, -2.0, 0.5]])
    a, dtb = np.array([-0.5, -1.0, -2.0]), np.array([0.1, 0.2, 0.7])
    b, g = ref.gdn_gates_ref(br, ar, a, dtb)
    want_b = 1.0 / (1.0 + np.exp(-br))
    x = ar + dtb
    want_g = a * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    np.testing.assert_allclose(b, want_b, rtol=1e-14, atol=0)
    np.testing.assert_allclose(g, want_g, rtol=1e-12, atol=1e-300)
    assert g[0, 2] == a[2] * (19.5 + 0.7)        # above 20 softplus is the identity, bit for bit
    assert np.all(g <= 0)


def test_l2norm_and_gated_rmsnorm():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 2, 16))
    x[1, 0] = 0.0                                 # all-zero head: divided by eps, stays zero (no NaN)
    y = ref.l2norm_ref(x, 1e-6)
    n = np.linalg.norm(x, axis=-1)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1)[n > 0], 1.0, rtol=1e-14)
    assert np.all(y[1, 0] == 0.0)
    o, z, w = rng.standard_normal((3, 2, 16)), rng.standard_normal((3, 2, 16)), rng.standard_normal(16)
    got = ref.gated_rmsnorm_ref(o, z, w, 1e-6)
    want = o / np.sqrt((o ** 2).mean(-1, keepdims=True) + 1e-6) * w * z / (1.0 + np.exp(-z))
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


def make_mixer_inputs(rng, T, Hk, Hv, S, K=4, dtype=np.float64):
    C = 2 * Hk * S + Hv * S
    P = C + Hv * S + 2 * Hv
    proj = rng.standard_normal((T, P))
    conv_w = rng.standard_normal((C, K)) * 0.5
    conv_state = rng.standard_normal((K - 1, C))
    ssm_a = -np.exp(rng.uniform(-1, 1, Hv))
    dt_bias = rng.uniform(-1, 1, Hv)
    norm_w = rng.uniform(0.5, 1.5, S)
    state = rng.standard_normal((Hv, S, S)) * 0.1
    return [a.astype(dtype) for a in (proj, conv_w, conv_state, ssm_a, dt_bias, norm_w, state)]


def mixer_direct(proj, conv_w, conv_state, ssm_a, dt_bias, norm_w, state, Hk, Hv, S, eps):
    """The mixer assembled by hand from the column layout, one token at a time."""
    T = proj.shape[0]
    C = 2 * Hk * S + Hv * S
    u = conv_direct(proj[:, :C], conv_w, conv_state)
    u = u / (1.0 + np.exp(-u))
    y = np.zeros((T, Hv * S))
    M = state.copy()
    for t in range(T):
        for j in range(Hv):
            kh = j % Hk
            qv = u[t, kh * S:(kh + 1) * S]
            kv = u[t, Hk * S + kh * S:Hk * S + (kh + 1) * S]
            qv = qv / max(np.linalg.norm(qv), eps)
            kv = kv / max(np.linalg.norm(kv), eps)
            vv = u[t, 2 * Hk * S + j * S:2 * Hk * S + (j + 1) * S]
            beta = 1.0 / (1.0 + np.exp(-proj[t, C + Hv * S + j]))
            x = proj[t, C + Hv * S + Hv + j] + dt_bias[j]
            g = ssm_a[j] * (x if x > 20 else np.log1p(np.exp(x)))
            M[j] *= np.exp(g)
            delta = beta * (vv - M[j].T @ kv)
            M[j] += np.outer(kv, delta)
            o = M[j].T @ qv / np.sqrt(S)
            z = proj[t, C + j * S:C + (j + 1) * S]
            y[t, j * S:(j + 1) * S] = o / np.sqrt(np.mean(o * o) + eps) * norm_w * z / (1.0 + np.exp(-z))
    return y, M


@pytest.mark.parametrize("Hk,Hv,S,T", [(2, 2, 16, 5), (1, 3, 16, 66), (2, 4, 32, 3)],
                         ids=["Hk2-Hv2-S16-T5", "Hk1-Hv3-S16-T66", "Hk2-Hv4-S32-T3"])
def test_mixer_matches_direct(Hk, Hv, S, T):
    rng = np.random.default_rng(9)
    args = make_mixer_inputs(rng, T, Hk, Hv, S)
    y_dir, s_dir = mixer_direct(*args, Hk, Hv, S, 1e-6)
    for chunked in (True, False):
        y, conv_state, st = ref.gdn_mixer_ref(*args, Hk, Hv, S, 1e-6, chunked=chunked)
        assert_close(y, y_dir, 1e-10, f"y chunked={chunked}")
        assert_close(st, s_dir, 1e-10, f"state chunked={chunked}")
        inputs = np.concatenate([args[2], args[0][:, :conv_state.shape[1]]])     # old state ++ qkv columns
        np.testing.assert_array_equal(conv_state, inputs[-3:])


def test_mixer_prefill_then_decode_equals_one_pass():
    rng = np.random.default_rng(10)
    Hk, Hv, S, T = 2, 4, 16, 70
    proj, conv_w, conv_state, ssm_a, dt_bias, norm_w, state = make_mixer_inputs(rng, T, Hk, Hv, S)
    y_all, cs_all, s_all = ref.gdn_mixer_ref(proj, conv_w, conv_state, ssm_a, dt_bias, norm_w, state,
                                            Hk, Hv, S, 1e-6)
    ys = []
    y, cs, st = ref.gdn_mixer_ref(proj[:65], conv_w, conv_state, ssm_a, dt_bias, norm_w, state,
                                  Hk, Hv, S, 1e-6)
    ys.append(y)
    for t in range(65, T):                                   # decode: one token at a time, recurrent form
        y, cs, st = ref.gdn_mixer_ref(proj[t:t + 1], conv_w, cs, ssm_a, dt_bias, norm_w, st, Hk, Hv, S, 1e-6,
                                      chunked=False)
        ys.append(y)
    assert_close(np.concatenate(ys), y_all, 1e-10, "y")
    assert_close(st, s_all, 1e-10, "state")
    np.testing.assert_array_equal(cs, cs_all)


def test_mixer_rejects_wrong_projection_width():
    rng = np.random.default_rng(11)
    args = make_mixer_inputs(rng, 3, 2, 4, 16)
    args[0] = args[0][:, :-1]
    with pytest.raises(ValueError, match="projection width"):
        ref.gdn_mixer_ref(*args, 2, 4, 16, 1e-6)


def test_ref_module_imports_no_numba():
    code = "import sys; import ninfer_numba.kernels.gdn.ref; assert 'numba' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
