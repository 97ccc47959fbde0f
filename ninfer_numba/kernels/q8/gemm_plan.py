"""The W8A16 GEMM's launch plan (gemm_w8a16.py): which activation tile and how many K splits, from a model of
the time of waves of CTAs on the GPU's SMs.

Each CTA computes a BW x BA output tile over its share of K in BK-deep stages. A grid whose last wave leaves
SMs idle wastes them for the whole wave, so the plan compares, for every tile height and split count, waves x
stages per CTA x the time of one stage at that tile height, and adds the cost of summing the splits.
"""
from __future__ import annotations

from functools import lru_cache

BW = 128                          # weight rows (output columns) per CTA: 2 warpgroups x 64
BK = 64                           # K per stage: 64 f16 = one 128-byte swizzled activation row

# time of one BK stage of a CTA with a BA-row activation tile alone on its SM, relative to BA = 256 (H200).
# 256/192/128 measured 2026-12-01 (a 128-row tile converts each weight for half as many products and keeps the
# tensor cores busy for half as long per stage); 64 and 32 on the line through them (~0.35 of a stage is the
# weights' loads and conversion, whatever BA). Tiles of 64 and 32 rows fit two CTAs per SM (125 and 107
# registers per thread, ptxas sm_90a); a CTA sharing its SM takes SHARED_STAGE_COST. These and the constants
# below: fitted 2026-12-03 to bench_prefill_gemm's 9B rows at M = 2-512 (five plans of each shape measured,
# results/2026-12-03_nvidia-h200_session18): the plans chosen are within 3 % of the fastest measured one.
STAGE_COST = {256: 1.0, 192: 0.7875, 128: 0.675, 64: 0.51, 32: 0.43}
SHARED_STAGE_COST = {64: 0.8, 32: 0.7}
STAGE_US = 1.1                    # one BA = 256 stage: 2 * 256 * 128 * 64 products at ~3.8 TOPS per SM
CTA_STAGES = 2                    # a CTA's prologue (3 stages in flight) and epilogue, in stages
MAX_SPLITS = 4                    # the most measured
SUM_GBPS = 1500.0                 # _sum_splits' read of the parts and write of out (one float per thread)
SUM_LAUNCH_US = 2.0


def split_ws_floats(n_sm: int) -> int:
    """Room for the split-K parts of any grid plan() splits: it splits only grids of at most ~2 waves, whose
    tiles cover at most 2 * n_sm * 128 x BW outputs (split x M x N floats)."""
    return 2 * n_sm * 128 * BW


def _slots(rows: int, n_sm: int) -> int:
    """CTAs the GPU holds at once with this tile."""
    return n_sm * (2 if rows in SHARED_STAGE_COST else 1)


@lru_cache(maxsize=4096)             # ~12 us of Python per call, on every GEMM of an eager forward
def plan(m: int, n: int, k: int, n_sm: int, most_splits: int = 1, ba: int | None = None) -> tuple[int, int]:
    """(activation tile rows, K splits) with the least predicted time: waves of CTAs (ceil(CTAs / slots)) times
    a CTA's stages (its share of K plus CTA_STAGES) at STAGE_COST[ba], plus _sum_splits' traffic when K is
    split. Large M: 256-row tiles, one split. Small M (a short prompt's forward, 1-128 rows): a grid of
    N / 128 tiles leaves most SMs idle (the 9B's down projection: 32 CTAs, each 192 stages long), so K is
    cut into up to most_splits parts (bounded by the workspace) and smaller tiles do less tensor work."""
    n_k = -(-k // BK)

    def ctas(rows, splits):
        return -(-m // rows) * -(-n // BW) * splits

    def cost(option):
        rows, splits = option
        shared = rows in SHARED_STAGE_COST and ctas(rows, splits) > n_sm
        stage = SHARED_STAGE_COST[rows] if shared else STAGE_COST[rows]
        us = -(-ctas(rows, splits) // _slots(rows, n_sm)) * (-(-n_k // splits) + CTA_STAGES) * stage * STAGE_US
        if splits > 1:
            us += SUM_LAUNCH_US + (splits + 1) * m * n * 4 / (SUM_GBPS * 1e3)
        return us

    def one_wave(rows, splits):
        """A split may only fill idle slots: measured, extra waves of shorter CTAs lost to one wave of
        longer ones (2 rows of the 9B's gate|up: 192 CTAs 64.0 us, 384 of half the length 68.9)."""
        return splits == 1 or ctas(rows, splits) <= _slots(rows, n_sm)
    options = [(rows, splits) for rows in ([ba] if ba else STAGE_COST)
               for splits in range(1, min(most_splits, MAX_SPLITS, n_k) + 1) if one_wave(rows, splits)]
    return min(options, key=cost)
