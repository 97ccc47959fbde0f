"""Prefill GEMMs against cuBLAS on the same shapes in the same run: every 9B / 27B projection, M = 512..8192.

    python -m benchmarks.kernels.bench_prefill_gemm [--models 9b,27b] [--m 512,2048,8192]
                                                    [--paths w8a16,mma] [--no-cublas] [--out FILE]
                                                    [--shapes gate|up,down]

Ours: ``gemm_w8a16`` (f16 activations, Q8_0 weights dequantized in the kernel; Hopper) and the int8 paths
of ``gemm_q8`` (``mma``: int8 mma.sync, ``dp4a``), timed by replaying a CUDA graph of n calls between events
(kernels run back to back, compile time excluded). cuBLAS through torch in the same process: int8
``torch._int_mm`` (the int8 x int8 -> int32 product, no scales: a lower bound on any Q8 GEMM's work) and f16
``torch.matmul`` (the W8A16 product's ceiling without the dequantization), timed the same way with
torch.cuda.CUDAGraph. Rate = 2·M·N·K / time (TOPS-equivalent for every path); each of our rows is also shown
as a fraction of cuBLAS int8 on the same shape. All operands are random (METHOD.md: zeros run faster).
A path ``w8a16[128]`` (any of gemm_plan.STAGE_COST) forces the W8A16 kernel's activation tile; ``w8a16+k``
gives it the split-K workspace the model gives it (short prompts: K split where the grid leaves SMs idle),
plain ``w8a16`` never splits. Each row also shows the weights' read rate (int8 + scales per time: the
ceiling of a short prompt's GEMM is the copy bandwidth, ~4 TB/s).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from ninfer_numba.kernels.q8.gemm import gemm_q8
from ninfer_numba.kernels.q8.gemm_plan import split_ws_floats
from ninfer_numba.kernels.q8.gemm_w8a16 import gemm_w8a16
from ninfer_numba.kernels.numba_env import cuda, sm_count
from benchmarks.timing import append_jsonl, gpu_name, time_graph

# (name, N, K) of every prefill projection; N of the fused input projections as in model/gpu_weights.py
SHAPES = {
    "9b": [("gate|up", 24576, 4096), ("down", 4096, 12288), ("gdn in", 12352, 4096),
           ("attn q|k|v", 10240, 4096), ("mixer out", 4096, 4096)],
    "27b": [("gate|up", 34816, 5120), ("down", 5120, 17408), ("gdn in", 16480, 5120),
            ("attn q|k|v", 14336, 5120), ("mixer out", 5120, 6144)],
}


def _n_inner(ops: float) -> int:
    return max(2, min(20, int(8e12 / ops)))


def time_ours(path: str, m: int, n: int, k: int, rng) -> float:
    """Median ms of one call of our kernel on random operands (path "w8a16[ba]": a forced activation tile)."""
    wq = cuda.to_device(rng.integers(-127, 128, (n, k), dtype=np.int8))
    ws = cuda.to_device((rng.uniform(0.5, 2.0, (n, k // 32)) * 1e-2).astype(np.float16))
    out = cuda.device_array((m, n), np.float32)
    if path.startswith("w8a16"):
        ba = int(path[path.index("[") + 1:path.index("]")]) if "[" in path else None
        split_ws = cuda.device_array(split_ws_floats(sm_count()), np.float32) if path.endswith("+k") else None
        xh = cuda.to_device(rng.standard_normal((m, k)).astype(np.float16))   # any column order: random
        fn = lambda s: gemm_w8a16(wq, ws, xh, out, ba=ba, split_ws=split_ws, stream=s)    # noqa: E731
    else:
        xq = cuda.to_device(rng.integers(-127, 128, (m, k), dtype=np.int8))
        xs = cuda.to_device(rng.uniform(1e-3, 1e-1, (m, k // 32)).astype(np.float32))
        fn = lambda s: gemm_q8(wq, ws, xq, xs, out, path=path, stream=s)   # noqa: E731
    return time_graph(fn, n_inner=_n_inner(2.0 * m * n * k), reps=7).median_ms


def time_cublas(kind: str, m: int, n: int, k: int) -> float:
    """Median ms of torch._int_mm (int8) or torch.matmul (f16) on the same shape, from CUDA-graph replays."""
    import torch
    if kind == "int8":
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda").t()   # column-major B
        fn = lambda: torch._int_mm(a, b)                                 # noqa: E731
    else:
        a = torch.randn((m, k), dtype=torch.float16, device="cuda")
        b = torch.randn((n, k), dtype=torch.float16, device="cuda").t()
        fn = lambda: torch.matmul(a, b)                                  # noqa: E731
    n_inner = _n_inner(2.0 * m * n * k)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n_inner):
            fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        graph.replay()
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / n_inner)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times)


def run(models, ms, paths, cublas: bool, shapes=None):
    rng = np.random.default_rng(0)
    rows = []
    for model in models:
        for m in ms:
            for name, n, k in SHAPES[model]:
                if shapes and name not in shapes:
                    continue
                ops = 2.0 * m * n * k
                row = {"model": model, "M": m, "shape": name, "N": n, "K": k}
                if cublas:
                    for kind in ("int8", "f16"):
                        row[f"cublas_{kind}_us"] = time_cublas(kind, m, n, k) * 1e3
                        row[f"cublas_{kind}_tops"] = ops / row[f"cublas_{kind}_us"] / 1e6
                for path in paths:
                    row[f"{path}_us"] = time_ours(path, m, n, k, rng) * 1e3
                    row[f"{path}_tops"] = ops / row[f"{path}_us"] / 1e6
                    row[f"{path}_weight_gbps"] = n * k * (1 + 2 / 32) / row[f"{path}_us"] / 1e3
                    if cublas:
                        row[f"{path}_vs_int8"] = row["cublas_int8_us"] / row[f"{path}_us"]
                rows.append(row)
                print(_line(row, paths, cublas), flush=True)
    return rows


def _line(r, paths, cublas):
    s = f"{r['model']:>4} M{r['M']:<5} {r['shape']:<11} {r['N']:>6}x{r['K']:<6}"
    if cublas:
        s += f" cuBLAS int8 {r['cublas_int8_tops']:6.0f}  f16 {r['cublas_f16_tops']:6.0f}"
    for p in paths:
        s += f" | {p} {r[f'{p}_us']:8.1f} us {r[f'{p}_tops']:6.0f} TOPS {r[f'{p}_weight_gbps']:5.0f} GB/s"
        if cublas:
            s += f" ({r[f'{p}_vs_int8']:.2f} of int8)"
    return s


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="9b,27b")
    ap.add_argument("--m", default="512,2048,8192", help="activation rows")
    ap.add_argument("--paths", default="w8a16,mma", help="our kernels: w8a16, mma, dp4a")
    ap.add_argument("--no-cublas", action="store_true", help="skip the torch/cuBLAS rows")
    ap.add_argument("--out", help="append one JSON object per row here")
    ap.add_argument("--shapes", help="only these projections (comma-separated names, e.g. 'gate|up,down')")
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    rows = run(args.models.split(","), [int(v) for v in args.m.split(",")], paths, not args.no_cublas,
               set(args.shapes.split(",")) if args.shapes else None)
    append_jsonl(args.out, rows, gpu=gpu_name())


if __name__ == "__main__":
    main()
