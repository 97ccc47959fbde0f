"""Radix select over the sampling order, for sample/device.py: layouts, state machine, histogram kernels.

Every token gets a 50-bit rank key R = key32(z) << 18 | (2^18 - 1 - i), where key32 maps float32 bits to an
order-preserving uint32, so the sampling order (z descending, index ascending) is R descending and every R is
distinct. Each position needed in that order (the top-k boundary, the top-p boundary, the drawn token) is
found by radix select over R: five digits of 11/11/10/9/9 bits, each digit one histogram pass of counts and
masses over the tokens whose higher digits match. Masses are exp(z - z_max) in float64 stored as fixed point
(2^-42 units, int64) so that sums are exact and independent of the order of atomics: the run is
deterministic, and it differs from the float64 reference only by truncation (< V·2^-42 of a total >= 1).

The last block of each launch (found with a threadfence + atomic ticket) runs the state machine: it scans
the histogram in descending order, picks the digit, and either resolves the select (one token left in the
bin, the full key known, or an exact tie group whose members have equal masses) or goes one level deeper.
The level-1 histogram covers all tokens and is kept, so each select after the first starts without a pass.
Worst case: top-k 2 levels + top-p 2 levels + draw 4 levels = N_REFINE = 8 refine launches.
"""
from __future__ import annotations

import math

import numpy as np

from ninfer_numba.kernels.kernel_cache import cached_jit
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.reduce import block_publish2

TPB = 32 if SIMULATOR else 256          # threads per block (the simulator runs ~6k threads/s)
ITEMS = 32 if SIMULATOR else 4          # tokens per thread when sizing the grid
G_MAX = 1024                            # blocks at most (partials buffer length)
NB = 2048                               # bins of the widest digit
WIDTHS = (11, 11, 10, 9, 9)             # digit widths of R, most significant first (sum 50)
SHIFTS = (39, 28, 18, 9, 0)             # right shift that brings each digit to bit 0
IDX_BITS, IDX_MASK = 18, 262143         # token index field of R: V <= 2^18
MASS_SCALE = 4398046511104.0            # 2^42: fixed-point unit of exp(z - z_max) in [0, 1]
N_REFINE = 8

# params [N_PARAMS] float64 (float values rounded to float32, integers exact); P_MASKED != 0: tokens whose bit
# in the workspace's mask is clear are excluded (a grammar's allowed set, engine/constraint.py)
P_TEMP, P_TOP_K, P_TOP_P, P_MIN_P, P_REP, P_PRES, P_FREQ, P_SEED_LO, P_SEED_HI, P_STEP, P_MASKED = range(11)
N_PARAMS = 11
# state st [N_ST] int64; stf [N_STF] float64
(S_PHASE, S_LEVEL, S_PREFIX, S_CNT_ABOVE, S_MASS_ABOVE, S_TARGET, S_K_POS, S_F_K, S_M_P, S_F_MP,
 S_M_MIN, S_F_MMIN, S_F_ALL) = range(13)
N_ST = 16
F_ZMAX, F_U = 0, 1
N_STF = 4
PH_DONE, PH_HIST1, PH_SEL_K, PH_SEL_P, PH_PICK, PH_EMIT = range(6)
D_ARGMAX, D_TRANSFORM, D_HIST = 0, 1, 2            # slots of the done-ticket counters


# ---------------------------------------------------------------- device helpers

@cuda.jit(device=True, inline=True)
def _rank_key(bits, i):
    """int64 R: larger = earlier in the sampling order (z descending, index ascending)."""
    b = np.int64(bits)
    if b >= 2147483648:          # negative float: more negative bits = smaller value
        k = np.int64(4294967295) - b
    else:
        k = b + np.int64(2147483648)
    return k * np.int64(262144) + (np.int64(IDX_MASK) - i)


@cuda.jit(device=True)
def _block_scan2(a, b, s_a, s_b):
    """Inclusive block-wide prefix sums of two int64 values (Hillis-Steele; s_*: shared [TPB] int64)."""
    tid = block_publish2(a, b, s_a, s_b)
    off = 1
    while off < TPB:
        ta = np.int64(0)
        tb = np.int64(0)
        if tid >= off:
            ta = s_a[tid - off]
            tb = s_b[tid - off]
        cuda.syncthreads()
        s_a[tid] += ta
        s_b[tid] += tb
        cuda.syncthreads()
        off *= 2
    return s_a[tid], s_b[tid]


@cuda.jit(device=True)
def _is_last_block(done, slot, s_flag):
    """Every block calls this once after its global writes; True in the block that arrives last."""
    cuda.threadfence()              # make this thread's global writes and atomics visible before the ticket
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        ticket = cuda.atomic.add(done, slot, 1)
        cuda.threadfence()          # acquire side: the block's later reads see what the other blocks wrote
        s_flag[0] = 1 if ticket == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    return s_flag[0] == 1


@cuda.jit(device=True)
def _start_select(st, phase, target):
    st[S_PHASE] = phase
    st[S_LEVEL] = 1
    st[S_PREFIX] = 0
    st[S_CNT_ABOVE] = 0
    st[S_MASS_ABOVE] = 0
    st[S_TARGET] = target


@cuda.jit(device=True)
def _start_top_p(st, top_p, f_k):
    t = np.int64(math.ceil(top_p * np.float64(f_k)))   # F(m) >= top_p·F(k)  <=>  F(m) >= ceil(...)
    _start_select(st, PH_SEL_P, min(max(t, np.int64(1)), f_k))


@cuda.jit(device=True)
def _start_pick(st, stf):
    """Kept prefix m = min(top-k, top-p, min-p positions); the draw is the first j with F(j) > u·F(m)."""
    m = st[S_M_MIN]
    f = st[S_F_MMIN]
    if st[S_M_P] < m:
        m = st[S_M_P]
        f = st[S_F_MP]
    if st[S_K_POS] < m:
        f = st[S_F_K]
    t = np.int64(math.floor(stf[F_U] * np.float64(f)))
    _start_select(st, PH_PICK, min(t, f - 1))


@cuda.jit(device=True)
def _hit(phase, target, c, m):
    """The select's condition on the counts/masses of a prefix of the order."""
    if phase == PH_SEL_K:
        return c >= target
    if phase == PH_SEL_P:
        return m >= target
    return m > target


@cuda.jit(device=True)
def _resolve(st, stf, params, level, nb, s_res, out_token):
    """Thread 0: apply the digit found by _advance; resolve the select or go one level deeper."""
    phase = st[S_PHASE]
    target = st[S_TARGET]
    b = s_res[0]
    c_above = st[S_CNT_ABOVE] + s_res[1]
    m_above = st[S_MASS_ABOVE] + s_res[2]
    cnt_b = s_res[3]
    mass_b = s_res[4]
    prefix = st[S_PREFIX] * nb + b
    pos = np.int64(0)
    f = np.int64(0)
    resolved = False
    if cnt_b == 1 or level == 5:
        pos = c_above + 1
        f = m_above + mass_b
        resolved = True
    elif level == 3 and phase != PH_PICK:
        # key32 fully known: an exact tie group, every member has the same mass q_t; count members in order
        q_t = mass_b // cnt_b
        r = target - c_above
        if phase == PH_SEL_P:
            r = (target - m_above + q_t - 1) // max(q_t, np.int64(1))
        r = min(max(r, np.int64(1)), cnt_b)
        pos = c_above + r
        f = m_above + r * q_t
        resolved = True
    if not resolved:
        st[S_LEVEL] = level + 1
        st[S_PREFIX] = prefix
        st[S_CNT_ABOVE] = c_above
        st[S_MASS_ABOVE] = m_above
    elif phase == PH_SEL_K:
        st[S_K_POS] = pos
        st[S_F_K] = f
        if params[P_TOP_P] < 1.0:
            _start_top_p(st, params[P_TOP_P], f)
        else:
            _start_pick(st, stf)
    elif phase == PH_SEL_P:
        st[S_M_P] = pos
        st[S_F_MP] = f
        _start_pick(st, stf)
    elif level == 5:
        out_token[0] = np.int32(IDX_MASK - (prefix & IDX_MASK))
        st[S_PHASE] = PH_DONE
    else:
        st[S_PHASE] = PH_EMIT         # the one token in this bin writes itself in the next launch
        st[S_PREFIX] = prefix


@cuda.jit(device=True)
def _advance(st, stf, params, hist1_cnt, hist1_mass, histl_cnt, histl_mass, fresh, out_token,
             s_a, s_b, s_res):
    """All threads of the last block: run selects as far as the available histograms allow.

    Level 1 always uses the kept all-token histogram, so a select that resolves lets the next one start at
    once; a deeper level needs the histogram of the launch that just ran (``fresh``), used once.
    """
    tid = cuda.threadIdx.x
    while True:
        cuda.syncthreads()          # thread 0's state writes are visible to the block after this
        phase = st[S_PHASE]
        if phase < PH_SEL_K or phase > PH_PICK:
            return
        level = st[S_LEVEL]
        hc = hist1_cnt
        hm = hist1_mass
        if level > 1:
            if not fresh:
                return
            fresh = False
            hc = histl_cnt
            hm = histl_mass
        nb = np.int64(1) << WIDTHS[level - 1]
        target = st[S_TARGET]
        c_above = st[S_CNT_ABOVE]
        m_above = st[S_MASS_ABOVE]
        per = (nb + TPB - 1) // TPB
        p0 = tid * per                 # this thread's positions p0..p0+per-1 of the descending bin order
        p1 = min(p0 + per, nb)
        c_sum = np.int64(0)
        m_sum = np.int64(0)
        for p in range(p0, p1):
            c_sum += hc[nb - 1 - p]
            m_sum += hm[nb - 1 - p]
        c_inc, m_inc = _block_scan2(c_sum, m_sum, s_a, s_b)
        cc = c_inc - c_sum
        mm = m_inc - m_sum
        if (not _hit(phase, target, c_above + cc, m_above + mm)
                and _hit(phase, target, c_above + c_inc, m_above + m_inc)):
            for p in range(p0, p1):    # exactly one thread owns the first bin where the condition holds
                b = nb - 1 - p
                if _hit(phase, target, c_above + cc + hc[b], m_above + mm + hm[b]):
                    s_res[0] = b
                    s_res[1] = cc
                    s_res[2] = mm
                    s_res[3] = hc[b]
                    s_res[4] = hm[b]
                    break
                cc += hc[b]
                mm += hm[b]
        cuda.syncthreads()
        if tid == 0:
            _resolve(st, stf, params, level, nb, s_res, out_token)


# ---------------------------------------------------------------- kernels

@cuda.jit(device=True, inline=True)
def _select_scratch():
    """The select kernels' shared arrays: bin counts [NB] int32 and fixed-point masses [NB] int64, two scan
    scratch rows [TPB] int64, the resolved select [8] int64, the last-block flag [1] int32. One per line:
    the simulator tells shared arrays apart by the line that declares them."""
    s_cnt = cuda.shared.array(NB, np.int32)
    s_mass = cuda.shared.array(NB, np.int64)
    s_a = cuda.shared.array(TPB, np.int64)
    s_b = cuda.shared.array(TPB, np.int64)
    s_res = cuda.shared.array(8, np.int64)
    s_flag = cuda.shared.array(1, np.int32)
    return s_cnt, s_mass, s_a, s_b, s_res, s_flag


@cached_jit()
def _hist1_kernel(z, zbits, params, st, stf, hist1_cnt, hist1_mass, histl_cnt, histl_mass, done, out_token):
    """Level-1 histogram (counts, fixed-point masses) of all tokens; m_min, F(m_min), F(V); start selects."""
    s_cnt, s_mass, s_a, s_b, s_res, s_flag = _select_scratch()
    if st[S_PHASE] != PH_HIST1:
        return
    tid = cuda.threadIdx.x
    V = z.shape[0]
    for b in range(tid, NB, TPB):
        s_cnt[b] = 0
        s_mass[b] = 0
    cuda.syncthreads()
    zmax = stf[F_ZMAX]
    min_p = params[P_MIN_P]
    n_min = np.int64(0)
    f_min = np.int64(0)
    f_all = np.int64(0)
    i = np.int64(cuda.blockIdx.x) * TPB + tid
    while i < V:
        e = math.exp(np.float64(z[i]) - zmax)
        q = np.int64(e * MASS_SCALE)
        b = _rank_key(zbits[i], i) >> SHIFTS[0]
        cuda.atomic.add(s_cnt, b, 1)
        if q > 0:
            cuda.atomic.add(s_mass, b, q)
        f_all += q
        if e >= min_p:
            n_min += 1
            f_min += q
        i += cuda.gridDim.x * TPB
    cuda.syncthreads()
    for b in range(tid, NB, TPB):
        if s_cnt[b] > 0:
            cuda.atomic.add(hist1_cnt, b, s_cnt[b])
            cuda.atomic.add(hist1_mass, b, s_mass[b])
    _block_scan2(n_min, f_min, s_a, s_b)
    if tid == 0:
        cuda.atomic.add(st, S_M_MIN, s_a[TPB - 1])
        cuda.atomic.add(st, S_F_MMIN, s_b[TPB - 1])
    _block_scan2(f_all, np.int64(0), s_a, s_b)
    if tid == 0:
        cuda.atomic.add(st, S_F_ALL, s_a[TPB - 1])
    if not _is_last_block(done, D_HIST, s_flag):
        return
    if tid == 0:
        done[D_HIST] = 0
        top_k = np.int64(params[P_TOP_K])
        top_p = params[P_TOP_P]
        st[S_K_POS] = V
        st[S_F_K] = st[S_F_ALL]
        st[S_M_P] = V + 1
        k_on = top_k > 0 and top_k < V
        if k_on:
            st[S_K_POS] = top_k       # F(k) is computed only when needed; min-p wins position ties
        if k_on and (top_p < 1.0 or st[S_M_MIN] > top_k):
            _start_select(st, PH_SEL_K, top_k)
        elif top_p < 1.0:
            _start_top_p(st, top_p, st[S_F_ALL])
        else:
            _start_pick(st, stf)
    _advance(st, stf, params, hist1_cnt, hist1_mass, histl_cnt, histl_mass, False, out_token, s_a, s_b, s_res)


@cached_jit()
def _refine_kernel(z, zbits, params, st, stf, hist1_cnt, hist1_mass, histl_cnt, histl_mass, done, out_token):
    """One deeper digit of the current select over the tokens matching its prefix (or emit the drawn token)."""
    s_cnt, s_mass, s_a, s_b, s_res, s_flag = _select_scratch()
    phase = st[S_PHASE]
    if phase < PH_SEL_K:
        return
    tid = cuda.threadIdx.x
    V = z.shape[0]
    level = st[S_LEVEL]
    prefix = st[S_PREFIX]
    shift = SHIFTS[level - 1]
    stride = cuda.gridDim.x * TPB
    if phase == PH_EMIT:
        i = np.int64(cuda.blockIdx.x) * TPB + tid
        while i < V:
            if (_rank_key(zbits[i], i) >> shift) == prefix:
                out_token[0] = np.int32(i)
                st[S_PHASE] = PH_DONE
            i += stride
        return
    nb = np.int64(1) << WIDTHS[level - 1]
    hi = shift + WIDTHS[level - 1]
    for b in range(tid, nb, TPB):
        s_cnt[b] = 0
        s_mass[b] = 0
    cuda.syncthreads()
    zmax = stf[F_ZMAX]
    i = np.int64(cuda.blockIdx.x) * TPB + tid
    while i < V:
        r = _rank_key(zbits[i], i)
        if (r >> hi) == prefix:
            b = (r >> shift) & (nb - 1)
            q = np.int64(math.exp(np.float64(z[i]) - zmax) * MASS_SCALE)
            cuda.atomic.add(s_cnt, b, 1)
            if q > 0:
                cuda.atomic.add(s_mass, b, q)
        i += stride
    cuda.syncthreads()
    for b in range(tid, nb, TPB):
        if s_cnt[b] > 0:
            cuda.atomic.add(histl_cnt, b, s_cnt[b])
            cuda.atomic.add(histl_mass, b, s_mass[b])
    if not _is_last_block(done, D_HIST, s_flag):
        return
    if tid == 0:
        done[D_HIST] = 0
    _advance(st, stf, params, hist1_cnt, hist1_mass, histl_cnt, histl_mass, True, out_token, s_a, s_b, s_res)
    cuda.syncthreads()
    for b in range(tid, nb, TPB):     # only this level's bins were touched
        histl_cnt[b] = 0
        histl_mass[b] = 0
