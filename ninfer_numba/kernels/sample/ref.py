"""Token selection in pure NumPy: penalties, greedy, temperature / top-k / top-p / min-p sampling, and the
counter-based random draw shared with the GPU kernels in sample/device.py.

This module must not import numba: the CPU engine imports it cheaply.

Semantics (the GPU kernels implement exactly these steps):
1. Penalties (llama.cpp): for every token with count > 0 in the penalty window, a positive logit is divided by
   ``repetition`` and a non-positive one multiplied; then ``frequency·count + presence`` is subtracted.
   Float parameters are rounded to float32 first (the device parameter buffer holds float32 values), the
   division/multiplication is float32, and the subtraction is done in float64 and rounded once to float32.
   In float64 the products count·frequency are exact, so a fused multiply-add on the GPU gives the same bits.
2. temperature 0: the argmax of the penalised logits, lowest index on ties.
3. Otherwise z = logits / temperature in float32. Tokens are ordered by z descending, ties by index ascending
   (-0.0 counts as +0.0). e_i = exp(z_i - z_max) in float64 (e of the best token is exactly 1).
4. Keep the first k of that order (top_k; 0 or >= V keeps all). S_k = sum of their e.
5. top_p < 1 (as float32): keep the shortest prefix whose mass reaches top_p·S_k.
6. min_p: keep tokens with e_i >= min_p, i.e. p_i >= min_p·p_max (a prefix of the order, e is monotone).
7. The kept set is the shortest of the three prefixes (m tokens, mass F(m)); the token drawn is the first j in
   order with F(j) > u·F(m), where F(j) is the mass of the first j tokens and u in [0, 1) the uniform draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Philox4x32-10 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int = 10) -> tuple[int, ...]:
    """Philox4x32 block function on Python ints (four 32-bit counter words, two 32-bit key words)."""
    c0, c1, c2, c3 = (int(c) & MASK32 for c in counter)
    k0, k1 = (int(k) & MASK32 for k in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        p0, p1 = PHILOX_M0 * c0, PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: int, step: int) -> float:
    """u in [0, 1) with 53 random bits for draw number ``step`` of the stream ``seed`` (both 64-bit)."""
    x0, x1, _, _ = philox4x32((step & MASK32, (step >> 32) & MASK32, 0, 0), (seed & MASK32, (seed >> 32) & MASK32))
    return ((x0 >> 5) * 67108864 + (x1 >> 6)) / 9007199254740992.0


def apply_penalties_ref(logits: np.ndarray, counts: np.ndarray, repetition: float = 1.0,
                        presence: float = 0.0, frequency: float = 0.0) -> np.ndarray:
    """logits: [V] float32, counts: [V] int32 (occurrences in the penalty window) -> [V] float32."""
    out = np.asarray(logits, np.float32).copy()
    counts = np.asarray(counts)
    hit = counts > 0
    rep = np.float32(repetition)
    l = out[hit]
    l = np.where(l > 0, l / rep, l * rep).astype(np.float32)
    term = counts[hit].astype(np.float64) * float(np.float32(frequency)) + float(np.float32(presence))
    out[hit] = (l.astype(np.float64) - term).astype(np.float32)
    return out


@dataclass(frozen=True)
class SortedMasses:
    """The sampling order of one logits vector and its masses, shared by every draw from it."""
    order: np.ndarray           # [V] int64 token ids, z descending, index ascending
    e: np.ndarray               # [V] float64 exp(z - z_max) in that order (e[0] == 1)
    c: np.ndarray               # [V] float64 prefix masses: c[j-1] = F(j), the mass of the first j tokens


def mask_allowed(words: np.ndarray, n: int) -> np.ndarray:
    """bool [n] from a packed mask (int32 words [ceil(n / 32)]): token i allowed where bit i % 32 of word i // 32
    is set, the packing the device sampler reads (engine/constraint.py's bitmask writes it)."""
    return np.unpackbits(np.asarray(words).view(np.uint8), bitorder="little")[:n].view(bool)


def apply_mask_ref(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    """logits [V] with every token the packed mask forbids at -inf (before the draw, as the device does)."""
    return np.where(mask_allowed(words, logits.shape[0]), logits, np.float32(-np.inf))


def sorted_masses(logits: np.ndarray, temperature: float) -> SortedMasses:
    """logits: [V] float32 (already penalised), temperature > 0. Steps 3 of the module docstring."""
    logits = np.asarray(logits, np.float32)
    V = logits.shape[0]
    z = (logits / np.float32(temperature)).astype(np.float32)
    order = np.lexsort((np.arange(V), -z))                    # z descending, then index ascending
    e = np.exp(z[order].astype(np.float64) - float(z[order[0]]))
    return SortedMasses(order, e, np.cumsum(e))


@dataclass(frozen=True)
class SampleTrace:
    """The choice of ``sample_ref`` and how close each decision was to flipping.

    Margins are absolute, in mass units (the best token has mass 1), so that a kernel's rounding bound can be
    compared with them directly: a kernel whose prefix masses and thresholds are each within B of the exact
    ones can only choose differently when ``mass_margin < B``; one whose exp(z - z_max) is within D of NumPy's
    only when ``min_p_margin < D``. A cut (top-p, min-p) that is not the one deciding the kept prefix counts
    only as far as a rounding could make it decide.
    """
    token: int
    pos: int                    # position of the token in the sampling order (0-based)
    n_kept: int                 # m: tokens left after top-k / top-p / min-p
    target: float               # u·F(m): the pick is the first position j with F(j + 1) > target
    pick_margin: float          # min |F(j) - target| over the two prefix masses around the pick
    top_p_margin: float         # min |F(j) - top_p·F(k)| over the top-p decisions (inf when top_p == 1)
    min_p_margin: float         # min |e_i - min_p| over the min-p decisions (inf when min_p == 0)
    f_total: float              # F(V), the mass of the whole vocabulary

    def cut_ambiguous(self, mass_tol: float, e_tol: float) -> bool:
        """The kept prefix m itself could differ under the given rounding bounds."""
        return self.top_p_margin < mass_tol or self.min_p_margin < e_tol

    def ambiguous(self, mass_tol: float, e_tol: float) -> bool:
        return self.pick_margin < mass_tol or self.cut_ambiguous(mass_tol, e_tol)


def select_sorted(sm: SortedMasses, top_k: int, top_p: float, min_p: float, u: float) -> SampleTrace:
    """Steps 4-7 of the module docstring on precomputed masses; u in [0, 1)."""
    c, e = sm.c, sm.e
    V = c.shape[0]
    inf = float("inf")
    k = int(top_k) if 0 < top_k < V else V
    m_p = m_min = V + 1
    tp, mp = float(np.float32(top_p)), float(np.float32(min_p))    # the device holds float32 parameters
    t_p = 0.0
    if tp < 1.0:
        t_p = tp * c[k - 1]
        m_p = int(np.searchsorted(c[:k], t_p, side="left")) + 1    # first j with F(j) >= top_p·F(k)
    if mp > 0.0:
        m_min = int(np.count_nonzero(e >= mp))                     # e is non-increasing: a prefix
    m = min(k, m_p, m_min)
    f = lambda j: c[j - 1] if j > 0 else 0.0                       # noqa: E731  F(j), F(0) = 0
    top_p_margin = inf
    if m_p == m:                # deciding: either neighbouring prefix may cross top_p·F(k)
        top_p_margin = min(abs(f(j) - t_p) for j in (m_p - 1, m_p))
    elif m_p <= V:              # not deciding: F(m) < top_p·F(k) must stay below it
        top_p_margin = t_p - f(m)
    min_p_margin = inf
    if m_min == m:
        min_p_margin = min(abs(e[j] - mp) for j in (m_min - 1, m_min) if 0 <= j < V)
    elif m_min <= V:
        min_p_margin = e[m - 1] - mp
    target = u * f(m)
    j = int(np.searchsorted(c[:m], target, side="right"))         # first j (0-based) with F(j+1) > target
    pick_margin = min(abs(c[i] - target) for i in (j - 1, j) if 0 <= i < m)
    return SampleTrace(int(sm.order[j]), j, m, target, pick_margin, top_p_margin, min_p_margin, float(c[-1]))


def sample_ref_detail(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                      u: float) -> SampleTrace:
    """logits: [V] float32 (already penalised). See the module docstring for the exact steps."""
    logits = np.asarray(logits, np.float32)
    if temperature == 0.0:
        i = int(np.argmax(logits))
        inf = float("inf")
        return SampleTrace(i, 0, 1, 0.0, inf, inf, inf, 1.0)
    return select_sorted(sorted_masses(logits, temperature), top_k, top_p, min_p, u)


def sample_ref(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """The token id chosen from ``logits`` [V] float32 for the uniform draw ``u`` in [0, 1)."""
    return sample_ref_detail(logits, temperature, top_k, top_p, min_p, u).token


def kept_probs_ref(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """[V] float64 probabilities of the truncated, renormalised distribution (for statistical checks)."""
    sm = sorted_masses(logits, temperature)
    m = select_sorted(sm, top_k, top_p, min_p, 0.0).n_kept
    p = np.zeros(sm.c.shape[0])
    p[sm.order[:m]] = sm.e[:m] / sm.c[m - 1]
    return p
