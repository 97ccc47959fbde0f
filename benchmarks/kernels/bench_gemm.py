"""Microbenchmark of the decode GEMV and the activation quantizers, timed inside replayed CUDA graphs.

    python -m benchmarks.kernels.bench_gemm [--model 9b|27b] [--only gemv,rows,sweep,step,quant] [--out FILE]
    .venv/bin/python -m pytest benchmarks/kernels/bench_gemm.py      (pytest-benchmark variants)

The prefill GEMMs have their own benchmark, side by side with cuBLAS: benchmarks/kernels/bench_prefill_gemm.py.

Rows: shape, µs per call, GB/s of the bytes the kernel must move (int8 weights + fp16 scales + activations
+ output), int8 TOPS (2·N·K / time) and the % of the 4.25 TB/s copy rate that bounds these kernels. GEMV
weights are rotated over
>= 4 copies (and enough to stream >= 3x the 60 MB L2 per rotation); "step" replays every GEMV of one decode
step of the model (8-27 GB of weights, far past L2). Weights are zero-filled: speed does not depend on the
values. With --out, one JSON object per row is appended.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from ninfer_numba.kernels.q8.gemm import gemm_q8
from ninfer_numba.kernels.q8.gemv import gemv_q8
from ninfer_numba.kernels.q8.gemv_rows import gemv_rows_q8
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.q8.quant_act import rmsnorm_quant, silu_mul_quant
from benchmarks.timing import append_jsonl, gpu_name, time_graph

COPY_GBS = 4250.0
L2_BYTES = 60e6
# per-model matrices (N rows, K cols) and how many layers use them
MODELS = {
    "9b": dict(E=4096, F=12288, gdn_in=8192 + 4096 + 32 + 32, attn_in=8192 + 1024 + 1024, mixer_out=4096,
               n_gdn=24, n_attn=8, vocab=248320),
    "27b": dict(E=5120, F=17408, gdn_in=10240 + 6144 + 48 + 48, attn_in=12288 + 1024 + 1024, mixer_out=6144,
                n_gdn=48, n_attn=16, vocab=248320),
}


def _zeros(shape, dtype):
    from numba.cuda.cudadrv import driver
    a = cuda.device_array(shape, dtype)
    driver.device_memset(a, 0, a.nbytes)
    return a


def _q8_matrix(n, k):
    return _zeros((n, k), np.int8), _zeros((n, k // 32), np.float16)


def _activation(rng, m, k):
    xq = cuda.to_device(rng.integers(-127, 128, (m, k), dtype=np.int8))
    xs = cuda.to_device(rng.uniform(1e-3, 1e-1, (m, k // 32)).astype(np.float32))
    return xq, xs


def _gemv_bytes(n, k, m=1):
    return n * k + n * (k // 32) * 2 + m * (k + (k // 32) * 4 + n * 4)


def gemv_shapes(c):
    return [("gate|up", 2 * c["F"], c["E"]), ("down", c["E"], c["F"]), ("gdn in", c["gdn_in"], c["E"]),
            ("attn in", c["attn_in"], c["E"]), ("mixer out", c["E"], c["mixer_out"]), ("output", c["vocab"], c["E"])]


def _time_gemv(rng, n, k, m, product) -> float:
    """ms per call of product(wq, ws, xq, xs, out, stream) on m activation rows, rotating over enough weight
    copies that they never sit in L2."""
    copies = max(4, math.ceil(3 * L2_BYTES / _gemv_bytes(n, k, m)) + 1)
    mats = [_q8_matrix(n, k) for _ in range(copies)]
    xq, xs = _activation(rng, m, k)
    out = _zeros((m, n), np.float32)
    state = {"i": 0}

    def launch(stream):
        wq, ws = mats[state["i"] % copies]
        state["i"] += 1
        product(wq, ws, xq, xs, out, stream)

    return time_graph(launch, n_inner=4 * copies, reps=10).median_ms


def _gemv_row(kernel, shape, nbytes, flops, ms):
    gbs = nbytes / ms / 1e6
    return dict(kernel=kernel, shape=shape, us=ms * 1e3, GBs=gbs, TOPS=flops / ms / 1e9, pct=100 * gbs / COPY_GBS,
                ceiling="copy 4.25 TB/s")


def bench_gemv(c, rng):
    rows = []
    for name, n, k in gemv_shapes(c):
        ms = _time_gemv(rng, n, k, 1, lambda wq, ws, xq, xs, out, s: gemv_q8(wq, ws, xq, xs, out, stream=s))
        rows.append(_gemv_row("gemv_q8", f"{name} {n}x{k}", _gemv_bytes(n, k), 2 * n * k, ms))
    return rows


def bench_gemv_rows(c, rng, batches=(1, 2, 4, 8, 16), impls=("ring", "tiles")):
    """The batched decode GEMV (q8/gemv_rows.py: impl "ring" streams through shared memory, "tiles" is the
    first version) at B active rows beside the single-row GEMV on each shape: a weight-bound kernel should
    cost about the same at any B (the `x single` column)."""
    rows = []
    for name, n, k in gemv_shapes(c):
        single = _time_gemv(rng, n, k, 1, lambda wq, ws, xq, xs, out, s: gemv_q8(wq, ws, xq, xs, out, stream=s))
        for impl in impls:
            for b in batches:
                ms = _time_gemv(rng, n, k, b, lambda wq, ws, xq, xs, out, s: gemv_rows_q8(
                    wq, ws, xq, xs, out, impl=impl, stream=s))
                row = _gemv_row(f"rows {impl} B{b}", f"{name} {n}x{k}", _gemv_bytes(n, k, b), 2 * b * n * k, ms)
                rows.append(dict(row, batch=b, impl=impl, x_single=ms / single))
    return rows


def bench_ring_sweep(c, rng, batches=(8, 16)):
    """The ring kernel's (warps per block, stages) and splits around its defaults on the 9B-like shapes
    whose tiles fill the SMs differently (q8/gemv_rows_ring.py choose_splits): which setting the hardware
    prefers, not the model."""
    from ninfer_numba.kernels.q8.gemv_rows_ring import choose_splits, gemv_rows_ring_q8, smem_bytes
    configs = {1: [(8, 2), (4, 2), (6, 2), (8, 3)], 2: [(8, 2), (4, 2), (6, 2)]}
    rows = []
    for name, n, k in gemv_shapes(c)[:3] + gemv_shapes(c)[4:5]:
        for b in batches:
            nt = (b + 7) // 8
            for warps, stages in configs[nt]:
                if smem_bytes(nt, warps, stages) > 227 * 1024:
                    continue
                auto = choose_splits(n, k, warps, stages, 132, nt)
                for sp in sorted({auto, *[s for s in (1, 2, 4) if warps % s == 0]}):
                    ms = _time_gemv(rng, n, k, b, lambda wq, ws, xq, xs, out, s: gemv_rows_ring_q8(
                        wq, ws, xq, xs, out, config=(warps, stages), splits=sp, stream=s))
                    tag = f"ring {warps}w{stages}s S{sp}{'*' if sp == auto else ''} B{b}"
                    rows.append(_gemv_row(tag, f"{name} {n}x{k}", _gemv_bytes(n, k, b), 2 * b * n * k, ms))
    return rows


def bench_decode_step(c, rng):
    """Every GEMV of one decode step, in model order, in one graph: the aggregate decode roofline."""
    e, f = c["E"], c["F"]
    plan = []
    for layer in range(c["n_gdn"] + c["n_attn"]):
        is_attn = layer % 4 == 3
        plan += [(c["attn_in"] if is_attn else c["gdn_in"], e), (e, c["mixer_out"]), (2 * f, e), (e, f)]
    plan.append((c["vocab"], e))
    mats = [_q8_matrix(n, k) for n, k in plan]
    acts = {k: _activation(rng, 1, k) for k in {k for _, k in plan}}
    outs = {n: _zeros(n, np.float32) for n in {n for n, _ in plan}}
    nbytes = sum(_gemv_bytes(n, k) for n, k in plan)

    def launch(stream):
        for (n, k), (wq, ws) in zip(plan, mats):
            xq, xs = acts[k]
            gemv_q8(wq, ws, xq, xs, outs[n], accumulate=(n == e), stream=stream)

    ms = time_graph(launch, n_inner=1, reps=10).median_ms
    gbs = nbytes / ms / 1e6
    return [dict(kernel="gemv_q8 decode step", shape=f"{len(plan)} GEMVs, {nbytes / 1e9:.2f} GB", us=ms * 1e3,
                 GBs=gbs, pct=100 * gbs / COPY_GBS, ceiling="copy 4.25 TB/s")]


def bench_quant(c, rng):
    rows = []
    e, f = c["E"], c["F"]
    for m in (1, 8192):
        x = cuda.to_device(rng.standard_normal((m, e)).astype(np.float32))
        w = cuda.to_device(np.ones(e, np.float32))
        xq, xs = _zeros((m, e), np.int8), _zeros((m, e // 32), np.float32)
        gu = cuda.to_device(rng.standard_normal((m, 2 * f)).astype(np.float32))
        hq, hs = _zeros((m, f), np.int8), _zeros((m, f // 32), np.float32)
        for name, fn, nbytes in (
                ("rmsnorm_quant", lambda s: rmsnorm_quant(x, w, 1e-6, xq, xs, stream=s), m * e * 4 + e * 4 + m * e * 1.125),
                ("silu_mul_quant", lambda s: silu_mul_quant(gu, hq, hs, stream=s), m * 2 * f * 4 + m * f * 1.125)):
            ms = time_graph(fn, n_inner=20, reps=10).median_ms
            gbs = nbytes / ms / 1e6
            rows.append(dict(kernel=name, shape=f"M{m}", us=ms * 1e3, GBs=gbs, pct=100 * gbs / COPY_GBS,
                             ceiling="copy 4.25 TB/s"))
    return rows


def _print(rows):
    print(f"{'kernel':<26} {'shape':<30} {'us':>10} {'GB/s':>8} {'TOPS':>8} {'% ceil':>7}  ceiling")
    for r in rows:
        gbs = f"{r['GBs']:.0f}" if "GBs" in r else "-"
        tops = f"{r['TOPS']:.1f}" if "TOPS" in r else "-"
        rel = f"  {r['x_single']:.2f}x single" if "x_single" in r else ""
        print(f"{r['kernel']:<26} {r['shape']:<30} {r['us']:>10.1f} {gbs:>8} {tops:>8} {r['pct']:>6.1f}%  {r['ceiling']}{rel}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="9b")
    ap.add_argument("--only", default="gemv,step,quant", help="comma list of gemv, rows, sweep, step, quant")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args(argv)
    c = MODELS[args.model]
    rng = np.random.default_rng(0)
    parts = set(args.only.split(","))
    rows = []
    if "gemv" in parts:
        rows += bench_gemv(c, rng)
    if "rows" in parts:
        rows += bench_gemv_rows(c, rng)
    if "sweep" in parts:
        rows += bench_ring_sweep(c, rng)
    if "step" in parts:
        rows += bench_decode_step(c, rng)
    if "quant" in parts:
        rows += bench_quant(c, rng)
    _print(rows)
    append_jsonl(args.out, rows, model=args.model, gpu=gpu_name())


# ---------------------------------------------------------------- pytest-benchmark variants --------------
# Collected by benchmarks/kernels/conftest.py (skipped without a GPU); fixtures kernel_bench, l2_bytes.

def test_gemv_9b_gate_up(kernel_bench, l2_bytes):
    from benchmarks.kernels.conftest import copies_to_defeat_l2, rotated
    rng = np.random.default_rng(0)
    _, n, k = gemv_shapes(MODELS["9b"])[0]
    nbytes = _gemv_bytes(n, k)
    sets = [(*_q8_matrix(n, k), *_activation(rng, 1, k), _zeros(n, np.float32))
            for _ in range(max(4, copies_to_defeat_l2(nbytes, l2_bytes)))]
    kernel_bench(rotated(lambda s, wq, ws, xq, xs, out: gemv_q8(wq, ws, xq, xs, out, stream=s), sets),
                 bytes_moved=nbytes, int8_ops=2 * n * k, n_inner=4 * len(sets))


def test_gemm_mma_9b_m2048(kernel_bench):
    rng = np.random.default_rng(0)
    c = MODELS["9b"]
    wq, ws = _q8_matrix(2 * c["F"], c["E"])
    xq, xs = _activation(rng, 2048, c["E"])
    out = _zeros((2048, 2 * c["F"]), np.float32)
    kernel_bench(lambda s: gemm_q8(wq, ws, xq, xs, out, path="mma", stream=s),
                 int8_ops=2.0 * 2048 * 2 * c["F"] * c["E"], n_inner=5, rounds=5)


if __name__ == "__main__":
    main()
