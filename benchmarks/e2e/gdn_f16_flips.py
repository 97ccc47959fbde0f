"""How far the GDN prefill's float16 roundings alone move its output, in int8 levels (CPU only).

    python -m benchmarks.e2e.gdn_f16_flips [--T 512] [--heads 16,16] [--seeds 4] [--decays mixed,strong,weak]
                                           [--decode 64]

The tie-following reference (benchmarks/e2e/act_follow.py) counts a float16 activation more than half an
int8 level (amax/127 of its 32-block) from the reference's own as a disagreement. On the GPU runs of
2026-12-03 every such element was a Gated DeltaNet layer's output (mixer_out) on the prefill path. That
path multiplies float16 operands (kernels/gdn/chunk_state_f16.py), which the reference emulates
(gdn_chunked_ref's f16_operands): same roundings, at the same places. What the emulation cannot follow are
the roundings that land the other way because the kernel's float32 input to a rounding differs from the
reference's in its last bits (rel_budget_f16_emulated in tests/kernels/gdn_cases.py). This measures that:
the emulated mixer twice, on the same layer inputs and on inputs moved by --noise (relative; default
(S + 64) · 2^-24, the float32 error of one of the kernels' dot products over S + BT terms, rel_budget), each
element's distance in levels of the first's 32-block; the float64 mixer twice in the same way (how far the
exact arithmetic itself moves such an element: its conditioning); and the distance between the float64
mixer and the emulated one (what the float16 operands do at all).

--decode N: then N decode tokens (float64, one at a time) from the two emulated prefills' final states, on
the same random projections: how far a decode step's output moves, in int8 levels, because the state it
starts from carries the prefill's float16 roundings (the follower's int8 rows on the decode path: a value
more than the tie bound, 0.1 level, from the midpoint is a disagreement there).
"""
from __future__ import annotations

import argparse

import numpy as np


def levels_apart(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in int8 levels of a's 32-blocks (amax / 127), per element; a, b [T, K], K % 32 == 0."""
    t, k = a.shape
    amax = np.abs(a).reshape(t, k // 32, 32).max(axis=2, keepdims=True)
    level = np.broadcast_to(np.where(amax == 0, 1.0, amax / 127.0), (t, k // 32, 32)).reshape(t, k)
    return np.abs(a - b) / level


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=512, help="prompt tokens (one prefill call)")
    ap.add_argument("--heads", default="16,16", help="Hk,Hv (the 0.8B: 16,16; the 9B: 16,32)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--decays", default="mixed,strong,weak")
    ap.add_argument("--decode", type=int, default=0, help="decode tokens after the prefill (0: none)")
    ap.add_argument("--noise", type=float, default=(128 + 64) * 2.0 ** -24, help="relative input move")
    a = ap.parse_args(argv)
    from tests.kernels.gdn_cases import make_inputs, mixer_reference
    hk, hv = (int(x) for x in a.heads.split(","))
    s = 128
    print(f"GDN mixer, T={a.T}, Hk={hk}, Hv={hv}, S={s}: elements more than 0.5 / 1 / 2 int8 levels apart, "
          f"and the largest distance; noise {a.noise:.3g}")
    print(f"{'decay':>6} {'seed':>4} {'elements':>9} | {'f16 vs f16 moved by noise':>30} | "
          f"{'f64 vs f64 moved by noise':>30} | {'f64 vs f16':>30}")
    for decay in a.decays.split(","):
        for seed in range(a.seeds):
            inp = make_inputs(seed, a.T, hk, hv, s, decay)
            y16, conv16, state16 = mixer_reference(inp, hk, hv, s, f16_operands=True)
            moved = dict(inp)
            rng = np.random.default_rng(1000 + seed)
            moved["proj"] = (inp["proj"].astype(np.float64) *
                             (1 + a.noise * rng.choice([-1.0, 1.0], inp["proj"].shape))).astype(np.float32)
            y16m, conv16m, state16m = mixer_reference(moved, hk, hv, s, f16_operands=True)
            y64 = mixer_reference(inp, hk, hv, s)[0]
            y64m = mixer_reference(moved, hk, hv, s)[0]
            cells = []
            for other, base in ((y16m, y16), (y64m, y64), (y16, y64)):
                lv = levels_apart(base, other)
                cells.append(f"{(lv > 0.5).sum():>7d} {(lv > 1).sum():>6d} {(lv > 2).sum():>5d} {lv.max():>8.3f}")
            print(f"{decay:>6} {seed:>4} {y16.size:>9d} | " + " | ".join(f"{c:>30}" for c in cells), flush=True)
            if a.decode:
                steps = make_inputs(2000 + seed, a.decode, hk, hv, s, decay)["proj"]
                ys = [mixer_reference(dict(inp, proj=steps, conv_state=c, state=h), hk, hv, s, chunked=False)[0]
                      for c, h in ((conv16, state16), (conv16m, state16m))]
                lv = levels_apart(ys[0], ys[1])
                print(f"{'':>6} {'':>4} {ys[0].size:>9d} | then {a.decode} decode tokens: elements more than "
                      f"0.1 / 0.5 / 1 level apart {(lv > 0.1).sum()} {(lv > 0.5).sum()} {(lv > 1).sum()}, "
                      f"largest {lv.max():.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
