"""Microbenchmark of the Gated DeltaNet kernels at the 9B / 27B shapes, timed inside replayed CUDA graphs.

    python -m benchmarks.kernels.bench_gdn [--model 9b,27b] [--only decode,prefill,stages] [--out FILE]

decode:  the fused gdn_decode_step; GB/s counts the state read + written (the bound) plus the small inputs,
         against the 4.25 TB/s copy rate. 32 state copies are rotated so replays stream from HBM.
prefill: the whole gdn_prefill (conv, norms, chunked recurrence, gated norm) at T = 8192 and 32768; ms per
         layer, tokens/s, ms for all GDN layers, and GFLOP/s of the chunked algebra, next to the published
         per-layer-per-8K figures of FLA (~0.5 ms), FlashInfer (~0.2 ms) and llama.cpp (~4.2 ms).
         Then, at each length, the mixer through to the out-projection's float16 activation two ways:
         gdn_prefill + to_f16 (the norm in the mixer) and gdn_prefill(normalize=False) + gated_rmsnorm_f16
         (the norm fused into the conversion: what the model runs).
stages:  each prefill kernel alone at T = 8192 (the state pass at value tiles of 32 and 64 columns).
Writes nothing unless --out is given (one JSON object per row, appended).
"""
from __future__ import annotations

import argparse

import numpy as np

from ninfer_numba.kernels.gdn import chunk as gdn_chunk
from ninfer_numba.kernels.gdn.chunk import GdnPrefillWorkspace, gdn_prefill
from ninfer_numba.kernels.gdn.chunk_form import BT
from ninfer_numba.kernels.gdn.chunk_intra_mma import launch_chunk_intra_mma
from ninfer_numba.kernels.gdn.chunk_state_f16 import launch_chunk_state_f16
from ninfer_numba.kernels.gdn.conv import conv_silu_norm_prefill
from ninfer_numba.kernels.gdn.recurrent import gdn_decode_step, make_decode_sync
from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.q8.act_f16 import gated_rmsnorm_f16, to_f16
from benchmarks.timing import append_jsonl, gpu_name, time_graph

COPY_GBS = 4250.0
SHAPES = {"9b": dict(Hk=16, Hv=32, S=128, n_layers=24), "27b": dict(Hk=16, Hv=48, S=128, n_layers=48)}
PUBLISHED_MS_PER_8K = {"FLA": 0.5, "FlashInfer": 0.2, "llama.cpp": 100.0 / 24}   # 9B, per GDN layer
EPS = 1e-6


def layer_inputs(Hk, Hv, S, T, rng):
    C = 2 * Hk * S + Hv * S
    P = C + Hv * S + 2 * Hv
    f32 = np.float32
    dev = lambda a: cuda.to_device(np.ascontiguousarray(a, f32))          # noqa: E731
    return dict(proj=dev(rng.standard_normal((T, P))), conv_w=dev(rng.standard_normal((C, 4)) * 0.5),
                conv_state=dev(np.zeros((3, C))), ssm_a=dev(-np.exp(rng.uniform(-1, 1, Hv))),
                dt_bias=dev(rng.uniform(-1, 1, Hv)), norm_w=dev(np.ones(S)),
                state=dev(rng.standard_normal((Hv, S, S)) * 0.1))


def chunk_flops(Hv, S, T):
    """FLOPs of the chunked algebra (gdn-chunked.md's count) for T tokens."""
    per_chunk = 2 * BT * BT * S + BT ** 3 / 3 + 2 * BT * BT * 2 * S + 4 * BT * S * S + 2 * BT * BT * 2 * S
    return Hv * T / BT * per_chunk


def bench_decode(Hk, Hv, S, n_layers, rng):
    inp = layer_inputs(Hk, Hv, S, 1, rng)
    n_copies = 32                                             # 32 x 2-3 MiB of state > 60 MB L2
    states = [cuda.to_device((rng.standard_normal((Hv, S, S)) * 0.1).astype(np.float32))
              for _ in range(n_copies)]
    y = cuda.device_array(Hv * S, np.float32)
    sync = make_decode_sync(Hk)
    proj = inp["proj"].reshape(-1)
    it = {"i": 0}

    def launch(stream):
        st = states[it["i"] % n_copies]
        it["i"] += 1
        gdn_decode_step(proj, inp["conv_w"], inp["conv_state"], inp["ssm_a"], inp["dt_bias"], inp["norm_w"],
                        st, y, sync, Hk, EPS, stream=stream, normalize=False)  # the model's launch

    ms = time_graph(launch, n_inner=n_copies, reps=20).median_ms
    C = 2 * Hk * S + Hv * S
    nbytes = 2 * Hv * S * S * 4 + proj.size * 4 + C * 4 * 4 * 2 + Hv * S * 4
    return [dict(kernel="gdn_decode_step", T=1, us=ms * 1e3, GBs=nbytes / ms / 1e6,
                 pct=100 * nbytes / ms / 1e6 / COPY_GBS, ceiling="copy 4.25 TB/s",
                 per_token_all_layers_us=ms * 1e3 * n_layers)]


def bench_prefill(Hk, Hv, S, n_layers, rng, lengths):
    rows = []
    for T in lengths:
        inp = layer_inputs(Hk, Hv, S, T, rng)
        ws = GdnPrefillWorkspace(T, Hk, Hv, S)
        y = cuda.device_array((T, Hv * S), np.float32)

        def launch(stream):
            gdn_prefill(inp["proj"], inp["conv_w"], inp["conv_state"], inp["ssm_a"], inp["dt_bias"],
                        inp["norm_w"], inp["state"], y, Hk, EPS, stream=stream, ws=ws)

        yh = cuda.device_array((T, Hv * S), np.float16)
        C = 2 * Hk * S + Hv * S

        def to_act(stream):
            launch(stream)
            to_f16(y, yh, stream=stream)

        def fused_to_act(stream):
            gdn_prefill(inp["proj"], inp["conv_w"], inp["conv_state"], inp["ssm_a"], inp["dt_bias"],
                        inp["norm_w"], inp["state"], y, Hk, EPS, stream=stream, ws=ws, normalize=False)
            gated_rmsnorm_f16(y, inp["proj"], C, inp["norm_w"], EPS, yh, stream=stream)

        for name, fn in (("gdn_prefill", launch), ("gdn_prefill + to_f16", to_act),
                         ("gdn_prefill raw + gated_f16", fused_to_act)):
            ms = time_graph(fn, n_inner=1, reps=5, warmup=1).median_ms
            gf = chunk_flops(Hv, S, T) / ms / 1e6
            rows.append(dict(kernel=name, T=T, us=ms * 1e3, GFLOPs=gf, tok_s=T / ms * 1e3,
                             all_layers_ms=ms * n_layers, ms_per_8k=ms * 8192 / T,
                             published_ms_per_8k_9b=PUBLISHED_MS_PER_8K))
        del ws
    return rows


def bench_stages(Hk, Hv, S, rng, T=8192):
    """Each prefill kernel alone (inputs from one full run)."""
    inp = layer_inputs(Hk, Hv, S, T, rng)
    ws = GdnPrefillWorkspace(T, Hk, Hv, S)
    y = cuda.device_array((T, Hv * S), np.float32)
    gdn_prefill(inp["proj"], inp["conv_w"], inp["conv_state"], inp["ssm_a"], inp["dt_bias"], inp["norm_w"],
                inp["state"], y, Hk, EPS, ws=ws)
    rows_tpb = 32 * gdn_chunk.WARPS_ROW
    stages = {
        "conv_silu_norm+shift": lambda s: conv_silu_norm_prefill(inp["proj"], inp["conv_w"], inp["conv_state"],
                                                                 ws.qk16, ws.v, S, EPS, s),
        "gates": lambda s: gdn_chunk.gates(inp["proj"], inp["ssm_a"], inp["dt_bias"], ws, T, s),
        "chunk_intra_mma": lambda s: launch_chunk_intra_mma(ws, T, s),
        "chunk_state_f16 BV=32": lambda s: launch_chunk_state_f16(ws, inp["state"], y, T, s, bv=32),
        "chunk_state_f16 BV=64": lambda s: launch_chunk_state_f16(ws, inp["state"], y, T, s, bv=64),
        "gated_norm": lambda s: gdn_chunk._gated_norm_kernel(S, Hk, Hv)[
            gdn_chunk._row_blocks(T * Hv, S), rows_tpb, s](inp["proj"], inp["norm_w"], y, T, EPS),
    }
    rows = []
    for name, fn in stages.items():
        ms = time_graph(fn, n_inner=1, reps=5, warmup=1).median_ms
        rows.append(dict(kernel=name, T=T, us=ms * 1e3))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="9b,27b")
    ap.add_argument("--only", default="decode,prefill,stages")
    ap.add_argument("--prefill-lengths", default="8192,32768")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    gpu = gpu_name()
    rows = []
    for model in args.model.split(","):
        shape = SHAPES[model]
        rng = np.random.default_rng(0)
        got = []
        if "decode" in parts:
            got += bench_decode(**shape, rng=rng)
        if "prefill" in parts:
            got += bench_prefill(**shape, rng=rng, lengths=[int(x) for x in args.prefill_lengths.split(",")])
        if "stages" in parts:
            got += bench_stages(shape["Hk"], shape["Hv"], shape["S"], rng)
        rows += [dict(r, model=model, gpu=gpu, **shape) for r in got]
    print(f"# {gpu}; published GDN prefill per 9B layer per 8K tokens: {PUBLISHED_MS_PER_8K}")
    print(f"{'model':5s} {'kernel':26s} {'T':>6s} {'µs':>10s}  details")
    for r in rows:
        extra = ""
        if "GBs" in r:
            extra = (f"{r['GBs']:.0f} GB/s ({r['pct']:.1f}% of copy); "
                     f"{r['per_token_all_layers_us']:.0f} µs/token all layers")
        elif "tok_s" in r:
            extra = (f"{r['tok_s']:.0f} tok/s, {r['ms_per_8k']:.3f} ms/layer/8K, "
                     f"{r['all_layers_ms']:.1f} ms all layers, {r['GFLOPs']:.0f} GFLOP/s")
        print(f"{r['model']:5s} {r['kernel']:26s} {r['T']:6d} {r['us']:10.1f}  {extra}")
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
