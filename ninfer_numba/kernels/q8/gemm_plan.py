"""The W8A16 GEMM's launch plan (gemm_w8a16.py): which activation tile and how many K splits, from a model of
the time of waves of CTAs on the GPU's SMs.

Each CTA computes a BW x BA output tile over its share of K in BK-deep stages. A grid whose last wave leaves
SMs idle wastes them for the whole wave, so the plan compares, for every tile height and split count, waves x
stages per CTA x the time of one stage at that tile height, and adds the cost of summing the splits.
"""
from __future__ import annotations

BW = 128                          # weight rows (output columns) per CTA: 2 warpgroups x 64
BK = 64                           # K per stage: 64 f16 = one 128-byte swizzled activation row

# time of one BK stage of a CTA with a BA-row activation tile, relative to BA = 256. 256/192/128 measured (H200,
# 2026-12-01: a 128-row tile converts each weight for half as many products and keeps the tensor cores busy
# for half as long per stage); 64 and 32 predicted from the line through them: ~0.35 per stage for the
# weights' loads and conversion whatever BA, the rest in proportion to BA.
STAGE_COST = {256: 1.0, 192: 0.7875, 128: 0.675, 64: 0.51, 32: 0.43}
STAGE_US = 1.1                    # one BA = 256 stage: 2 * 256 * 128 * 64 products at ~3.8 TOPS per SM
CTA_STAGES = 4                    # a CTA's prologue (3 stages in flight) and epilogue, in stages
MAX_SPLITS = 8
SUM_GBPS = 3000.0                 # _sum_splits' read of the parts and write of out, at copy bandwidth
SUM_LAUNCH_US = 2.0


def split_ws_floats(n_sm: int) -> int:
    """Room for the split-K parts of any grid plan() splits: it splits only grids of at most ~2 waves, whose
    tiles cover at most 2 * n_sm * 128 x BW outputs (split x M x N floats)."""
    return 2 * n_sm * 128 * BW


def plan(m: int, n: int, k: int, n_sm: int, most_splits: int = 1, ba: int | None = None) -> tuple[int, int]:
    """(activation tile rows, K splits) with the least predicted time: waves of CTAs (ceil(CTAs / SMs)) times
    a CTA's stages (its share of K plus CTA_STAGES) at STAGE_COST[ba], plus _sum_splits' traffic when K is
    split. Large M: 256-row tiles, one split. Small M (a short prompt's forward, 1-128 rows): a grid of
    N / 128 tiles leaves most SMs idle (the 9B's down projection: 32 CTAs, each 192 stages long), so K is
    cut into up to most_splits parts (bounded by the workspace) and smaller tiles do less tensor work."""
    n_k = -(-k // BK)

    def cost(option):
        rows, splits = option
        ctas = -(-m // rows) * -(-n // BW) * splits
        us = -(-ctas // n_sm) * (-(-n_k // splits) + CTA_STAGES) * STAGE_COST[rows] * STAGE_US
        if splits > 1:
            us += SUM_LAUNCH_US + (splits + 1) * m * n * 4 / (SUM_GBPS * 1e3)
        return us
    options = [(rows, splits) for rows in ([ba] if ba else STAGE_COST)
               for splits in range(1, min(most_splits, MAX_SPLITS, n_k) + 1)]
    return min(options, key=cost)
