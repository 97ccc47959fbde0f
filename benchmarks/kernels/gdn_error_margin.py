"""Relative RMS error of gdn_prefill against the float64 reference, next to the test budget.

    python -m benchmarks.kernels.gdn_error_margin [--shapes 9B,27B] [--T 64,1023,8192]

Prints one line per (shape, T, output): error, budget (tests/kernels/gdn_cases.rel_budget_f16) and their ratio:
how much of the budget (float16 operands in the state pass, float32 elsewhere) the kernels use. Needs a GPU.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))
from gdn_cases import SHAPES_GPU, make_inputs, mixer_reference, rel_budget_f16, to_device  # noqa: E402

from ninfer_numba.kernels.gdn.chunk import gdn_prefill  # noqa: E402
from ninfer_numba.kernels.numba_env import cuda  # noqa: E402


def rel_err(out, want) -> float:
    return float(np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="9B,27B")
    ap.add_argument("--T", default="64,1023,8192")
    args = ap.parse_args(argv)
    for shape in args.shapes.split(","):
        Hk, Hv, S = SHAPES_GPU[shape]
        for T in (int(x) for x in args.T.split(",")):
            inp = make_inputs(100 + T, T, Hk, Hv, S)
            dev = to_device(inp)
            y = cuda.device_array((T, Hv * S), np.float32)
            gdn_prefill(cuda.to_device(inp["proj"]), dev["conv_w"], dev["conv_state"], dev["ssm_a"],
                        dev["dt_bias"], dev["norm_w"], dev["state"], y, Hk, 1e-6)
            y_ref, _, state_ref = mixer_reference(inp, Hk, Hv, S)
            budget = rel_budget_f16(S, T)
            for name, out, want in (("y", y.copy_to_host(), y_ref), ("state", dev["state"].copy_to_host(),
                                                                    state_ref)):
                err = rel_err(out, want)
                print(f"{shape:4s} T={T:6d} {name:5s} rel RMS {err:.3e}  budget {budget:.3e}  "
                      f"used {err / budget:.3f}", flush=True)


if __name__ == "__main__":
    main()
