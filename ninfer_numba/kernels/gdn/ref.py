"""NumPy reference for the Gated DeltaNet (GDN) token mixer of Qwen3.5 (arch ``qwen35``).

Written from the math in reference/qwen35-format.md §5 ("GDN layer") and reference/gdn-chunked.md; the
chunked derivation is in README.md beside this file. Pure NumPy: importing this module imports no numba, so
the CPU reference model can use it.

Precision: every function computes in float64 and returns arrays in the floating dtype of its main input
(float32 in, float32 out; float64 in, float64 out), so the CPU model gets float32 and tests can ask for a
float64 oracle.

Shape letters: T tokens, C conv channels, K conv taps, Hk key heads, Hv value heads, S head dim (key dim =
value dim = S in Qwen3.5; the recurrences also accept a key dim different from the value dim).
State layout: ``state[j]`` is M_j with math shape [key dim, value dim]; value head j reads key head j % Hk.
"""
from __future__ import annotations

import numpy as np


def _out_dtype(x: np.ndarray) -> np.dtype:
    """float64 stays float64; every other input dtype gives float32."""
    return np.dtype(np.float64) if np.asarray(x).dtype == np.float64 else np.dtype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # split by sign so exp never overflows
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softplus(x: np.ndarray) -> np.ndarray:
    """ggml's softplus: x above 20, log1p(exp(x)) below (the clamp only guards exp from overflowing)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _silu(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(x)


def gdn_gates_ref(beta_raw: np.ndarray, alpha_raw: np.ndarray, ssm_a: np.ndarray,
                  dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token, per-value-head write strength and log-decay.

    beta_raw: [T, Hv], alpha_raw: [T, Hv], ssm_a: [Hv] (= -exp(A_log), so <= 0), dt_bias: [Hv].
    Returns beta [T, Hv] = sigmoid(beta_raw) and g [T, Hv] = ssm_a * softplus(alpha_raw + dt_bias);
    the decay applied to the state is exp(g) in (0, 1].
    """
    dt = _out_dtype(beta_raw)
    b = _sigmoid(np.asarray(beta_raw, np.float64))
    g = np.asarray(ssm_a, np.float64) * _softplus(np.asarray(alpha_raw, np.float64)
                                                   + np.asarray(dt_bias, np.float64))
    return b.astype(dt), g.astype(dt)


def causal_conv1d_ref(x: np.ndarray, w: np.ndarray,
                      state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over time with carried state; no activation.

    x: [T, C] inputs, w: [C, K] taps (tap K-1 multiplies the current token), state: [K-1, C] the previous
    K-1 inputs, oldest first (zeros at the start of a sequence).
    y[t, c] = sum_k w[c, k] * x_{t-K+1+k}[c]. Returns y [T, C] and new_state [K-1, C] (the last K-1
    inputs of state ++ x, so splitting a sequence and carrying the state equals one pass).
    """
    dt = _out_dtype(x)
    K = w.shape[1]
    C = x.shape[1]
    xs = np.concatenate([np.asarray(state, np.float64).reshape(K - 1, C),
                         np.asarray(x, np.float64)], axis=0)               # [K-1+T, C]
    T = x.shape[0]
    w64 = np.asarray(w, np.float64)
    y = np.zeros((T, C))
    for k in range(K):
        y += w64[:, k][None, :] * xs[k:k + T]
    new_state = xs[xs.shape[0] - (K - 1):]
    return y.astype(dt), new_state.astype(dt)


def l2norm_ref(x: np.ndarray, eps: float) -> np.ndarray:
    """x / max(||x||, eps) over the last axis (ggml's l2_norm)."""
    x64 = np.asarray(x, np.float64)
    n = np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True))
    return (x64 / np.maximum(n, eps)).astype(_out_dtype(x))


def _key_head_index(Hv: int, Hk: int) -> np.ndarray:
    """Value head j reads key head j % Hk (ggml's tiled broadcast; the converter reorders V heads for it)."""
    if Hv % Hk != 0:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    return np.arange(Hv) % Hk


def gdn_recurrent_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray,
                      state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token-by-token gated delta rule (the decode form), all value heads at once.

    q, k: [T, Hk, Dk] (already L2-normalised), v: [T, Hv, Dv], beta, g: [T, Hv], state: [Hv, Dk, Dv].
    Per token and value head j (key head j % Hk):
        M <- exp(g) M;  delta = beta (v - M^T k);  M <- M + k delta^T;  o = M^T q / sqrt(Dk).
    Returns o [T, Hv, Dv] and the new state [Hv, Dk, Dv].
    """
    dt = _out_dtype(v)
    T, Hv, Dv = v.shape
    kh = _key_head_index(Hv, q.shape[1])
    q64 = np.asarray(q, np.float64)[:, kh]                                 # [T, Hv, Dk]
    k64 = np.asarray(k, np.float64)[:, kh]                                 # [T, Hv, Dk]
    v64 = np.asarray(v, np.float64)
    b64 = np.asarray(beta, np.float64)
    decay = np.exp(np.asarray(g, np.float64))                              # [T, Hv]
    M = np.array(state, np.float64)                                        # [Hv, Dk, Dv]
    scale = 1.0 / np.sqrt(q.shape[2])
    o = np.empty((T, Hv, Dv))
    for t in range(T):
        M *= decay[t][:, None, None]
        kv = np.einsum("hkv,hk->hv", M, k64[t])
        delta = b64[t][:, None] * (v64[t] - kv)                            # [Hv, Dv]
        M += k64[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", M, q64[t]) * scale
    return o.astype(dt), M.astype(dt)


def gdn_chunked_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray,
                    state: np.ndarray, chunk: int = 64,
                    f16_operands: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Chunkwise-parallel form of ``gdn_recurrent_ref`` (same arguments, same results up to rounding).

    Per chunk of c <= ``chunk`` tokens and value head, with G the in-chunk cumulative sum of g and h the
    state at the chunk start (README.md derives it):
      A = strict_tril(b_i (k_i . k_j) exp(G_i - G_j));  T = (I + A)^-1
      W = T (b exp(G) K);  U = T (b V);  V' = U - W h
      O = [(Q exp(G)) h + tril(Q K^T exp(G_i - G_j)) V'] / sqrt(Dk)
      h <- exp(G_last) h + (K exp(G_last - G))^T V'
    Decay factors are formed from differences G_i - G_j with i >= j (never ratios of exponentials), so
    every exponent is <= 0. The last chunk may be partial.
    f16_operands: round to float16 where the GPU prefill does: q and k (the workspace's qk16, from which
    the intra-chunk products are exact), W and P as the workspace holds them, h at the chunk start, V' and
    e^(G_last - G) V' (chunk_state_f16.py); everything else float64.
    """
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    dt = _out_dtype(v)
    T, Hv, Dv = v.shape
    kh = _key_head_index(Hv, q.shape[1])
    q64 = np.asarray(q, np.float64)[:, kh].transpose(1, 0, 2)              # [Hv, T, Dk]
    k64 = np.asarray(k, np.float64)[:, kh].transpose(1, 0, 2)              # [Hv, T, Dk]
    rnd = _f16 if f16_operands else (lambda x: x)                         # where the GPU rounds, or not
    q64, k64 = rnd(q64), rnd(k64)
    v64 = np.asarray(v, np.float64).transpose(1, 0, 2)                     # [Hv, T, Dv]
    b64 = np.asarray(beta, np.float64).T                                   # [Hv, T]
    g64 = np.asarray(g, np.float64).T                                      # [Hv, T]
    h = np.array(state, np.float64)                                        # [Hv, Dk, Dv]
    scale = 1.0 / np.sqrt(q.shape[2])
    o = np.empty((Hv, T, Dv))
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        c = t1 - t0
        Qc, Kc, Vc = q64[:, t0:t1], k64[:, t0:t1], v64[:, t0:t1]
        bc = b64[:, t0:t1]                                                 # [Hv, c]
        G = np.cumsum(g64[:, t0:t1], axis=1)                               # [Hv, c]
        diff = G[:, :, None] - G[:, None, :]                               # [Hv, c, c]: G_i - G_j
        lower_incl = np.tril(np.ones((c, c), bool))
        lower_strict = np.tril(np.ones((c, c), bool), -1)
        # exponent masked to -inf above the diagonal, where G_i - G_j > 0 could overflow
        decay_ij = np.exp(np.where(lower_incl, diff, -np.inf))             # [Hv, c, c]
        A = np.where(lower_strict, bc[:, :, None] * (Kc @ Kc.transpose(0, 2, 1)) * decay_ij, 0.0)
        IA = np.eye(c)[None] + A
        W = np.linalg.solve(IA, (bc * np.exp(G))[:, :, None] * Kc)         # [Hv, c, Dk]
        U = np.linalg.solve(IA, bc[:, :, None] * Vc)                       # [Hv, c, Dv]
        attn = (Qc @ Kc.transpose(0, 2, 1)) * decay_ij                     # [Hv, c, c], zero above diag
        G_last = G[:, -1]                                                  # [Hv]
        e_k = np.exp(G_last[:, None] - G)[:, :, None]                     # [Hv, c, 1]
        hr = rnd(h)                                                        # the operand copy of h
        Vn = U - rnd(W) @ hr                                               # [Hv, c, Dv]
        o[:, t0:t1] = (np.exp(G)[:, :, None] * (Qc @ hr) + rnd(attn) @ rnd(Vn)) * scale
        h = np.exp(G_last)[:, None, None] * h + Kc.transpose(0, 2, 1) @ rnd(e_k * Vn)
    return o.transpose(1, 0, 2).astype(dt), h.astype(dt)


def _f16(x: np.ndarray) -> np.ndarray:
    """x rounded to float16, back in float64."""
    return np.asarray(x).astype(np.float16).astype(np.float64)


def gated_rmsnorm_ref(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm(o over the last axis) * w * silu(z).

    o, z: [..., S], w: [S] (ssm_norm, shared by all heads, stored without +1).
    """
    o64 = np.asarray(o, np.float64)
    rms = np.sqrt(np.mean(o64 * o64, axis=-1, keepdims=True) + eps)
    y = o64 / rms * np.asarray(w, np.float64) * _silu(np.asarray(z, np.float64))
    return y.astype(_out_dtype(o))


def split_proj_columns(P: int, Hk: int, Hv: int, S: int) -> dict[str, slice]:
    """Column ranges of the fused GDN input projection [T, P]: qkv | z | beta_raw | alpha_raw.

    qkv holds C = 2*Hk*S + Hv*S conv channels (q = first Hk*S, k = next Hk*S, v = last Hv*S).
    """
    C = 2 * Hk * S + Hv * S
    expected = C + Hv * S + 2 * Hv
    if P != expected:
        raise ValueError(f"projection width {P} != C + Hv*S + 2*Hv = {expected} (Hk={Hk}, Hv={Hv}, S={S})")
    return {"qkv": slice(0, C), "z": slice(C, C + Hv * S),
            "beta": slice(C + Hv * S, C + Hv * S + Hv), "alpha": slice(C + Hv * S + Hv, expected)}


def gdn_mixer_ref(proj: np.ndarray, conv_w: np.ndarray, conv_state: np.ndarray, ssm_a: np.ndarray,
                  dt_bias: np.ndarray, norm_w: np.ndarray, state: np.ndarray, Hk: int, Hv: int, S: int,
                  eps: float, chunked: bool = True, f16_operands: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The whole GDN token mixer between the fused input projection and ssm_out.

    proj: [T, P] with columns qkv [0, C) | z [C, C+Hv*S) | beta_raw (Hv) | alpha_raw (Hv),
    conv_w: [C, K], conv_state: [K-1, C], ssm_a, dt_bias: [Hv], norm_w: [S], state: [Hv, S, S].
    conv -> silu -> split q, k, v -> l2norm q, k (eps) -> gates -> recurrence (chunked or token by
    token) -> gated RMSNorm with z (eps). Returns y [T, Hv*S], new_conv_state [K-1, C], new_state.
    f16_operands (chunked only): gdn_chunked_ref's, the GPU prefill's precision.
    """
    T, P = proj.shape
    cols = split_proj_columns(P, Hk, Hv, S)
    conv_y, new_conv_state = causal_conv1d_ref(proj[:, cols["qkv"]], conv_w, conv_state)
    u = _silu(np.asarray(conv_y, np.float64)).astype(conv_y.dtype)          # [T, C]
    q = l2norm_ref(u[:, :Hk * S].reshape(T, Hk, S), eps)
    k = l2norm_ref(u[:, Hk * S:2 * Hk * S].reshape(T, Hk, S), eps)
    v = u[:, 2 * Hk * S:].reshape(T, Hv, S)
    beta, g = gdn_gates_ref(proj[:, cols["beta"]], proj[:, cols["alpha"]], ssm_a, dt_bias)
    if chunked:
        o, new_state = gdn_chunked_ref(q, k, v, beta, g, state, f16_operands=f16_operands)
    else:
        o, new_state = gdn_recurrent_ref(q, k, v, beta, g, state)
    z = proj[:, cols["z"]].reshape(T, Hv, S)
    y = gated_rmsnorm_ref(o, z, norm_w, eps).reshape(T, Hv * S)
    return y, new_conv_state, new_state
