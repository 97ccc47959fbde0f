"""A second, deliberately plain forward pass of qwen35, token by token in float64, for cross-checking.

Written straight from reference/qwen35-format.md §5 with explicit per-head loops and none of the package's
kernels or references: it reads the float tensors from a dict (NumPy order) and a small spec.
"""
from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def independent_logits(t: dict[str, np.ndarray], s, tokens: list[int]) -> np.ndarray:
    t = {k: v.astype(np.float64) for k, v in t.items()}
    d, S, Hk, Hv, K = s.head_dim, s.ssm_state, s.ssm_groups, s.ssm_heads, s.conv_kernel
    C = 2 * Hk * S + Hv * S
    kcache = {i: [] for i in range(s.n_layer)}
    vcache = {i: [] for i in range(s.n_layer)}
    conv_hist = {i: [np.zeros(C) for _ in range(K - 1)] for i in range(s.n_layer)}
    M = {i: np.zeros((Hv, S, S)) for i in range(s.n_layer)}
    out_w = t["token_embd.weight"] if s.tied else t["output.weight"]
    logits = []
    for pos, tok in enumerate(tokens):
        x = t["token_embd.weight"][tok].copy()
        for i in range(s.n_layer):
            b = f"blk.{i}."
            h = _rms(x, t[b + "attn_norm.weight"], s.eps)
            if (i + 1) % 4 == 0:
                qg = t[b + "attn_q.weight"] @ h
                k = (t[b + "attn_k.weight"] @ h).reshape(s.n_head_kv, d)
                v = (t[b + "attn_v.weight"] @ h).reshape(s.n_head_kv, d)
                k = np.stack([_rms(k[j], t[b + "attn_k_norm.weight"], s.eps) for j in range(s.n_head_kv)])
                half = s.n_rot // 2
                ang = pos * s.rope_base ** (-np.arange(half) * 2.0 / s.n_rot)

                def rope(vec):
                    z = vec.copy()
                    a, bb = vec[:half], vec[half:2 * half]
                    z[:half] = a * np.cos(ang) - bb * np.sin(ang)
                    z[half:2 * half] = a * np.sin(ang) + bb * np.cos(ang)
                    return z
                k = np.stack([rope(k[j]) for j in range(s.n_head_kv)])
                kcache[i].append(k)
                vcache[i].append(v)
                o = []
                for hh in range(s.n_head):
                    q = _rms(qg[2 * d * hh: 2 * d * hh + d], t[b + "attn_q_norm.weight"], s.eps)
                    gate = qg[2 * d * hh + d: 2 * d * (hh + 1)]
                    q = rope(q)
                    j = hh // (s.n_head // s.n_head_kv)
                    sc = np.array([q @ kk[j] for kk in kcache[i]]) / np.sqrt(d)
                    p = np.exp(sc - sc.max())
                    p /= p.sum()
                    oh = sum(pp * vv[j] for pp, vv in zip(p, vcache[i]))
                    o.append(oh * _sig(gate))
                a_out = t[b + "attn_output.weight"] @ np.concatenate(o)
            else:
                m = t[b + "attn_qkv.weight"] @ h
                z = t[b + "attn_gate.weight"] @ h
                beta = _sig(t[b + "ssm_beta.weight"] @ h)
                alpha = t[b + "ssm_alpha.weight"] @ h + t[b + "ssm_dt.bias"]
                sp = np.where(alpha > 20, alpha, np.log1p(np.exp(np.minimum(alpha, 20))))
                g = t[b + "ssm_a"] * sp
                hist = conv_hist[i] + [m]
                w = t[b + "ssm_conv1d.weight"]                           # [C, K]
                c = sum(w[:, kk] * hist[kk] for kk in range(K))
                conv_hist[i] = hist[1:]
                u = c * _sig(c)
                qa, ka, va = u[:Hk * S], u[Hk * S:2 * Hk * S], u[2 * Hk * S:]
                ys = []
                for j in range(Hv):
                    kh = j % Hk
                    q = qa[kh * S:(kh + 1) * S]
                    k = ka[kh * S:(kh + 1) * S]
                    q = q / max(np.linalg.norm(q), s.eps)
                    k = k / max(np.linalg.norm(k), s.eps)
                    vj = va[j * S:(j + 1) * S]
                    Mj = M[i][j] * np.exp(g[j])
                    delta = beta[j] * (vj - Mj.T @ k)
                    Mj = Mj + np.outer(k, delta)
                    M[i][j] = Mj
                    oj = Mj.T @ q / np.sqrt(S)
                    zj = z[j * S:(j + 1) * S]
                    ys.append(_rms(oj, t[b + "ssm_norm.weight"], s.eps) * zj * _sig(zj))
                a_out = t[b + "ssm_out.weight"] @ np.concatenate(ys)
            x = x + a_out
            h2 = _rms(x, t[b + "post_attention_norm.weight"], s.eps)
            gt = t[b + "ffn_gate.weight"] @ h2
            up = t[b + "ffn_up.weight"] @ h2
            x = x + t[b + "ffn_down.weight"] @ (gt * _sig(gt) * up)
        logits.append(out_w @ _rms(x, t["output_norm.weight"], s.eps))
    return np.array(logits)
