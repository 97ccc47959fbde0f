"""NumPy reference of the rotated, Lloyd-Max-coded KV cache: the transform, the codes, their packing, and
attention computed in the rotated domain.

One cached vector x (a key or a value of one token and KV head, d = head_dim, a power of two) is stored as
  n = ||x|| in float16, and codes c_i in [0, 2^bits) of y = R x, where R = H·diag(s) / sqrt(d) is
  orthonormal: H the Walsh-Hadamard matrix, s fixed random signs (seeded, one vector per layer role).
Rotated by R, the coordinates of a vector look Gaussian with variance n²/d whatever x was, so one codebook
serves every vector: the Lloyd-Max quantizer of the unit Gaussian, scaled by n/sqrt(d). Its distortion is
0.0345 per coordinate at 3 bits and 0.0095 at 4 (relative to n²/d). Bytes per vector at d = 256: 96 (3 bit)
or 128 (4 bit) of codes plus 2 of norm, against 512 in float16; 8 bits (the q8 type): 256 + 2, distortion
4.1e-5.

Attention never rotates a cached vector back: R is orthonormal, so q·k = (R q)·(R k) and
sum_j p_j v_j = Rᵀ sum_j p_j (R v_j). The query is rotated once per head, scores are taken against the
decoded rotated keys, values are accumulated rotated, and the output is rotated back once.

Packing (per vector, little-endian): 4 bits: code i in byte i // 2, low nibble first; 3 bits: each group of
8 codes fills 3 bytes as one 24-bit word, code i of the group at bits 3i..3i+2; 8 bits: code i in byte i.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

BITS = (3, 4, 8)
# --kv-type -> (key bits, value bits); q8: 8-bit codes of the same rotation and codebook family (258 bytes a
# vector at d = 256, against 272 in llama.cpp's q8_0 and 512 in float16)
KV_TYPES = {"k3v3": (3, 3), "k4v3": (4, 3), "k4v4": (4, 4), "q8": (8, 8)}


def vector_bytes(kv_type: str, d: int) -> tuple[int, int]:
    """Bytes one cached key and one cached value of size d take: codes plus the float16 norm, or float16."""
    if kv_type == "f16":
        return 2 * d, 2 * d
    k_bits, v_bits = KV_TYPES[kv_type]
    return d * k_bits // 8 + 2, d * v_bits // 8 + 2


def role_seeds(layer: int) -> tuple[int, int]:
    """The rotation seeds of one attention layer's keys and values (fixed: a cache written by one run is read
    with the same signs by any other)."""
    return 1000 + 2 * layer, 1001 + 2 * layer


def kv_round_trip(kv_type: str, layer: int):
    """(k, v) -> (k', v'): what a ``kv_type`` cache returns for the keys and values [..., d] it stores, in
    the original domain, float32 (attention over them equals attention_rotated_ref up to float rounding,
    since the rotation is orthonormal). The reference model applies it where the kernels quantize."""
    k_bits, v_bits = KV_TYPES[kv_type]
    k_seed, v_seed = role_seeds(layer)

    def store(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (dequantize(*quantize(k, k_bits, k_seed), k_bits, k_seed).astype(np.float32),
                dequantize(*quantize(v, v_bits, v_seed), v_bits, v_seed).astype(np.float32))
    return store


def _phi(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@lru_cache(maxsize=None)
def lloyd_max_gaussian(bits: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(levels [2^bits], thresholds [2^bits - 1], distortion) of the minimum-MSE scalar quantizer of N(0, 1),
    by Lloyd's iteration to a fixed point: thresholds at midpoints, levels at the conditional means of their
    intervals."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, not {bits}")
    levels = np.linspace(-2.5, 2.5, 1 << bits)
    for _ in range(20000):
        t = 0.5 * (levels[1:] + levels[:-1])
        edges = np.concatenate(([-np.inf], t, [np.inf]))
        mass = np.diff(_cdf(edges))
        new = (_phi(edges[:-1]) - _phi(edges[1:])) / mass
        done = np.max(np.abs(new - levels)) < 1e-13
        levels = new
        if done:
            break
    t = 0.5 * (levels[1:] + levels[:-1])
    edges = np.concatenate(([-np.inf], t, [np.inf]))
    mass = np.diff(_cdf(edges))
    distortion = float(1.0 - np.sum(mass * levels * levels))     # E[x²] - E[q(x)²] at the centroid condition
    return levels, t, distortion


@lru_cache(maxsize=None)
def hadamard_signs(d: int, seed: int) -> np.ndarray:
    """The fixed random signs s [d] (±1.0) of the rotation for ``seed``."""
    return np.where(np.random.default_rng(seed).integers(0, 2, d) == 1, 1.0, -1.0)


def fwht(x: np.ndarray) -> np.ndarray:
    """Walsh-Hadamard transform along the last axis (length a power of two), unnormalised, float64."""
    y = np.array(x, np.float64, copy=True)
    d = y.shape[-1]
    if d & (d - 1):
        raise ValueError(f"length {d} is not a power of two")
    h = 1
    while h < d:
        y = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        y = y.reshape(*y.shape[:-3], d)
        h *= 2
    return y


def rotate(x: np.ndarray, seed: int) -> np.ndarray:
    """R x = H (s ⊙ x) / sqrt(d) along the last axis (orthonormal), float64."""
    d = x.shape[-1]
    return fwht(np.asarray(x, np.float64) * hadamard_signs(d, seed)) / math.sqrt(d)


def rotate_back(y: np.ndarray, seed: int) -> np.ndarray:
    """Rᵀ y = s ⊙ (H y) / sqrt(d) (H is symmetric), float64."""
    d = y.shape[-1]
    return fwht(y) * hadamard_signs(d, seed) / math.sqrt(d)


def quantize(x: np.ndarray, bits: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectors x [..., d] -> (codes uint8 [..., d] in [0, 2^bits), norms float16 [...])."""
    levels, thresholds, _ = lloyd_max_gaussian(bits)
    d = x.shape[-1]
    norms = np.linalg.norm(np.asarray(x, np.float64), axis=-1).astype(np.float16)
    scale = np.sqrt(d) / np.maximum(norms.astype(np.float64), np.finfo(np.float16).tiny)
    y = rotate(x, seed) * scale[..., None]                    # unit-variance coordinates
    codes = np.searchsorted(thresholds, y).astype(np.uint8)   # nearest level: thresholds are midpoints
    return codes, norms


def decode_rotated(codes: np.ndarray, norms: np.ndarray, bits: int) -> np.ndarray:
    """The stored vectors in the rotated domain, float64 [..., d]: level[c] · n / sqrt(d)."""
    levels, _, _ = lloyd_max_gaussian(bits)
    d = codes.shape[-1]
    return levels[codes] * (norms.astype(np.float64) / math.sqrt(d))[..., None]


def dequantize(codes: np.ndarray, norms: np.ndarray, bits: int, seed: int) -> np.ndarray:
    """The stored vectors back in the original domain, float64 [..., d]."""
    return rotate_back(decode_rotated(codes, norms, bits), seed)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes uint8 [..., d] -> bytes uint8 [..., d·bits/8] in the layout of the module docstring."""
    c = codes.astype(np.uint32)
    if bits == 8:
        return codes.astype(np.uint8)
    if bits == 4:
        return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
    if bits == 3:
        g = c.reshape(*c.shape[:-1], -1, 8)
        word = np.zeros(g.shape[:-1], np.uint32)
        for i in range(8):
            word |= g[..., i] << (3 * i)
        out = np.stack([(word >> (8 * b)) & 0xFF for b in range(3)], axis=-1).astype(np.uint8)
        return out.reshape(*c.shape[:-1], -1)
    raise ValueError(f"bits must be one of {BITS}, not {bits}")


def unpack(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    """Inverse of ``pack``: bytes [..., d·bits/8] -> codes uint8 [..., d]."""
    p = packed.astype(np.uint32)
    if bits == 8:
        return packed.astype(np.uint8)
    if bits == 4:
        out = np.empty((*p.shape[:-1], d), np.uint8)
        out[..., 0::2] = p & 0xF
        out[..., 1::2] = p >> 4
        return out
    if bits == 3:
        b = p.reshape(*p.shape[:-1], -1, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        out = np.stack([(word >> (3 * i)) & 7 for i in range(8)], axis=-1).astype(np.uint8)
        return out.reshape(*p.shape[:-1], d)
    raise ValueError(f"bits must be one of {BITS}, not {bits}")


def attention_rotated_ref(q: np.ndarray, k_codes: np.ndarray, k_norms: np.ndarray, v_codes: np.ndarray,
                          v_norms: np.ndarray, q_pos: np.ndarray, k_bits: int, v_bits: int, k_seed: int,
                          v_seed: int) -> np.ndarray:
    """Causal GQA attention over a coded cache, computed as the kernels will: q rotated once per head, scores
    against the decoded rotated keys, values accumulated rotated, the output rotated back once.

    q [T, H, d]; k_codes, v_codes [L, Hkv, d] uint8; k_norms, v_norms [L, Hkv] float16; q_pos [T] -> o
    [T, H, d] float32 (float64 inside), the same semantics as flash_attn.ref.attention_ref.
    """
    T, H, d = q.shape
    L, Hkv, _ = k_codes.shape
    group = H // Hkv
    qr = rotate(q, k_seed)                                              # [T, H, d]
    kr = np.repeat(decode_rotated(k_codes, k_norms, k_bits), group, axis=1)     # [L, H, d]
    vr = np.repeat(decode_rotated(v_codes, v_norms, v_bits), group, axis=1)
    s = np.einsum("thd,lhd->thl", qr, kr) / math.sqrt(d)
    s = np.where(np.arange(L)[None, None, :] <= np.asarray(q_pos)[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o_rot = np.einsum("thl,lhd->thd", p, vr)
    return rotate_back(o_rot, v_seed).astype(np.float32)
