"""Microbenchmark of the attention kernels at the 9B / 27B shapes, timed inside replayed CUDA graphs.

    python -m benchmarks.kernels.bench_attn [--model 9b|27b] [--only rope,decode,kvq,prefill,kvq_prefill] [--mma]
        [--out FILE]

Prints one row per shape: µs per call, GB/s (bytes the kernel must move) and TFLOP/s, with the % of the
ceiling that bounds it (4.25 TB/s copy rate for rope and decode; torch SDPA's 602 / 643 TFLOP/s at
T = 8192 / 32768 for prefill, reference/anchors.md). Working sets under ~3× the 60 MB L2 are rotated over
several buffer copies so the timings come from HBM. With --out, one JSON object per row is appended.
--mma adds rows for the fp16 tensor-core prefill (prefill_mma.py) with 4-warp and 8-warp blocks. kvq: the
decode attention over the 3/4-bit caches (kernels/kvq/decode.py, split-K partials and their combine) on
random codes, beside attention_decode's f16 rows above (--kvq-types, --kvq-lengths, --kvq-splits and
--kvq-variants choose the cases); rows kvq_decode_<type>_tokens* time the second
partial (kernels/kvq/decode_tokens.py, a lane per key token) in the same process, rows *_mma the third
(kernels/kvq/decode_mma.py, tensor cores). kvq_prefill: the
tensor-core prefill over coded caches (kernels/kvq/prefill.py: tiles decoded from the codes; the queries'
rotation included) beside the float16 one (prefill_mma, 4 warps) on the same lengths. rope also times the
decode step's launch (T = 1) into an f16 and a k3v3 cache with blocks of 64, 128 and 256 threads.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from ninfer_numba.kernels.numba_env import cuda
from ninfer_numba.kernels.flash_attn.decode import alloc_decode_workspace, attention_decode
from ninfer_numba.kernels.flash_attn.prefill import attention_prefill
from ninfer_numba.kernels.flash_attn.prefill_mma import launch_prefill_mma
from ninfer_numba.kernels.flash_attn.rope import qk_norm_rope_store
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.kvq.decode import KvqDecodeWorkspace, kvq_attention_decode
from ninfer_numba.kernels.kvq.prefill import kvq_attention_prefill
from ninfer_numba.kernels.kvq.ref import KV_TYPES, vector_bytes
from ninfer_numba.model.qwen35 import KVQ_SPLITS
from benchmarks.timing import append_jsonl, gpu_name, time_graph

COPY_GBS = 4250.0
SDPA_TFLOPS = {2048: 369.0, 8192: 602.0, 32768: 643.0}
SHAPES = {"9b": dict(H=16, Hkv=4, d=256), "27b": dict(H=24, Hkv=4, d=256)}
L2_BYTES = 60e6


def _copies(nbytes: float) -> int:
    """Buffer copies to rotate so that one graph replay streams ≥ 3× L2 from HBM (at most 8)."""
    return max(1, min(8, math.ceil(3 * L2_BYTES / max(nbytes, 1.0))))


def _rand(shape, dtype, rng):
    return cuda.to_device(rng.standard_normal(shape).astype(dtype))


def bench_rope(H, Hkv, d, rng):
    rows = []
    for T in (1, 512, 8192):
        P = 2 * d * H + 2 * d * Hkv
        # reads the q, k, v columns (not the gate), writes q f32 and k, v f16
        nbytes = T * (H + 2 * Hkv) * d * 4 + T * H * d * 4 + 2 * T * Hkv * d * 2
        sets = [(_rand((T, P), np.float32, rng), cuda.device_array((T, H, d), np.float32),
                 cuda.device_array((Hkv, T, d), np.float16), cuda.device_array((Hkv, T, d), np.float16))
                for _ in range(_copies(nbytes))]
        w = _rand(d, np.float32, rng)
        pos0 = cuda.to_device(np.zeros(1, np.int32))
        state = {"i": 0}

        def launch(stream):
            proj, q, kc, vc = sets[state["i"] % len(sets)]
            state["i"] += 1
            qk_norm_rope_store(proj, w, w, pos0, q, kc, vc, H=H, Hkv=Hkv, n_rot=64, base=1e7, eps=1e-6,
                               stream=stream)

        ms = time_graph(launch, n_inner=4 * len(sets), reps=10).median_ms
        rows.append(dict(kernel="qk_norm_rope_store", T=T, us=ms * 1e3, GBs=nbytes / ms / 1e6,
                         pct=100 * nbytes / ms / 1e6 / COPY_GBS, ceiling="copy 4.25 TB/s"))
    return rows + bench_rope_step(H, Hkv, d, rng)


def bench_rope_step(H, Hkv, d, rng, max_seq=64):
    """The decode step's rope kernel (T = 1) storing into an f16 cache and coding into a k3v3 one, with blocks
    of 64 (the default), 128 and 256 threads: a latency-bound launch of H + 2·Hkv blocks whose coded key
    blocks are the longest (rows *_t<threads>)."""
    rows = []
    proj = _rand((1, 2 * d * H + 2 * d * Hkv), np.float32, rng)
    w = _rand(d, np.float32, rng)
    q = cuda.device_array((1, H, d), np.float32)
    pos0 = cuda.to_device(np.array([max_seq // 2], np.int32))
    f16 = [cuda.device_array((Hkv, max_seq, d), np.float16) for _ in range(2)]
    tab = KvqTables(d, 3, 1)
    coded = [tab.role(cuda.device_array((Hkv, max_seq, d * 3 // 8), np.uint8),
                      cuda.device_array((Hkv, max_seq), np.uint16)) for _ in range(2)]
    for kind, (kc, vc) in (("f16", f16), ("k3v3", coded)):
        for threads in (64, 128, 256):
            def launch(stream, kc=kc, vc=vc, threads=threads):
                qk_norm_rope_store(proj, w, w, pos0, q, kc, vc, H=H, Hkv=Hkv, n_rot=min(64, d), base=1e7,
                                   eps=1e-6, threads=threads, stream=stream)
            ms = time_graph(launch, n_inner=20, reps=10).median_ms
            rows.append(dict(kernel=f"rope_step_{kind}_t{threads}", T=1, us=ms * 1e3, pct=float("nan"),
                             ceiling="latency"))
    return rows


def bench_decode(H, Hkv, d, rng):
    rows = []
    ws = alloc_decode_workspace(H, d)
    for L in (1, 799, 8192, 32768):
        nbytes = Hkv * L * d * 2 * 2                        # K and V, f16, read once per step
        sets = [(_rand((Hkv, L, d), np.float16, rng), _rand((Hkv, L, d), np.float16, rng))
                for _ in range(_copies(nbytes))]
        q = _rand((1, H, d), np.float32, rng)
        proj = _rand((1, 2 * d * H + 2 * d * Hkv), np.float32, rng)
        out = cuda.device_array(H * d, np.float32)
        kv_len = cuda.to_device(np.array([L], np.int32))
        state = {"i": 0}

        def launch(stream):
            kc, vc = sets[state["i"] % len(sets)]
            state["i"] += 1
            attention_decode(q, kc, vc, kv_len, proj, out, ws, stream=stream)

        ms = time_graph(launch, n_inner=4 * len(sets), reps=10).median_ms
        flops = 4.0 * H * L * d
        rows.append(dict(kernel="attention_decode", L=L, us=ms * 1e3, GBs=nbytes / ms / 1e6,
                         TFLOPs=flops / ms / 1e9, pct=100 * nbytes / ms / 1e6 / COPY_GBS,
                         ceiling="copy 4.25 TB/s", n_splits=ws.n_splits))
    return rows


def bench_kvq_decode(H, Hkv, d, rng, kv_types=("k3v3", "k4v4"), lengths=(8192, 32768), splits=(KVQ_SPLITS,),
                     variants=("lanes", "tokens", "mma")):
    """Each coded type at each cache length: each partial with its combine, then each alone, for every split
    count (rows carry n_splits; a short cache against a long one separates a partial's fixed cost)."""
    rows = []
    q = _rand((H, d), np.float16, rng)
    proj = _rand((1, 2 * d * H + 2 * d * Hkv), np.float32, rng)
    out = cuda.device_array(H * d, np.float32)
    tags = {"lanes": "", "tokens": "_tokens", "mma": "_mma"}
    for kv_type, L, n_splits in ((t, L, n) for t in kv_types for L in lengths for n in splits):
        ws = KvqDecodeWorkspace(H, d, n_splits)
        (kb, vb), (k_row, v_row) = KV_TYPES[kv_type], vector_bytes(kv_type, d)
        k_tab, v_tab = KvqTables(d, kb, 1), KvqTables(d, vb, 2)
        nbytes = Hkv * L * (k_row + v_row)               # codes and norms, read once per step
        norms = (rng.uniform(5, 20, (Hkv, L)).astype(np.float16)).view(np.uint16)

        def coded(row):
            return cuda.to_device(rng.integers(0, 256, (Hkv, L, row - 2), dtype=np.uint8))
        sets = [(coded(k_row), cuda.to_device(norms), coded(v_row), cuda.to_device(norms))
                for _ in range(_copies(nbytes))]
        kv_len = cuda.to_device(np.array([L], np.int32))
        state = {"i": 0}

        # the whole call, then each of its two kernels alone (which of them holds the fixed cost), for
        # both partial kernels
        for variant, tag in ((v, tags[v]) for v in variants):
            for part, kernels in (("", ("partial", "combine")), ("_partial", ("partial",)),
                                  ("_combine", ("combine",))):
                name = tag + part

                def launch(stream, kernels=kernels, variant=variant, ws=ws):
                    kc, kn, vc, vn = sets[state["i"] % len(sets)]
                    state["i"] += 1
                    kvq_attention_decode(q, kc, kn, vc, vn, kv_len, k_tab, v_tab, out, ws, stream=stream,
                                         proj=proj, kernels=kernels, variant=variant)

                ms = time_graph(launch, n_inner=4 * len(sets), reps=10).median_ms
                rows.append(dict(kernel=f"kvq_decode_{kv_type}{name}", L=L, us=ms * 1e3,
                                 GBs=nbytes / ms / 1e6, TFLOPs=4.0 * H * L * d / ms / 1e9,
                                 pct=100 * nbytes / ms / 1e6 / COPY_GBS, ceiling="copy 4.25 TB/s",
                                 n_splits=ws.n_splits))
    return rows


def _prefill_variants(mma: bool):
    """(kernel name, launcher) pairs to time: the float32 kernel, then the tensor-core block sizes."""
    variants = [("attention_prefill", attention_prefill)]
    if mma:
        for n_warps in (4, 8):
            variants.append((f"prefill_mma_w{n_warps}",
                             lambda *a, stream=0, n=n_warps: launch_prefill_mma(*a, stream=stream, n_warps=n)))
    return variants


def bench_prefill(H, Hkv, d, rng, lengths, mma=False):
    rows = []
    for T in lengths:
        q = _rand((T, H, d), np.float32, rng)
        kc, vc = _rand((Hkv, T, d), np.float16, rng), _rand((Hkv, T, d), np.float16, rng)
        proj = _rand((T, 2 * d * H + 2 * d * Hkv), np.float32, rng)
        out = cuda.device_array((T, H * d), np.float32)
        pos0 = cuda.to_device(np.zeros(1, np.int32))
        flops = 4.0 * H * T * T * d / 2                     # causal half, as torch SDPA is counted
        for name, prefill in _prefill_variants(mma):
            # the float32 kernel runs ~20 TFLOP/s: fewer inner calls for it at long T
            n_inner = max(1, min(10, int((2e12 if name == "attention_prefill" else 2e13) / flops)))
            ms = time_graph(lambda s: prefill(q, kc, vc, pos0, proj, out, stream=s),
                            n_inner=n_inner, reps=3 if flops > 1e12 else 10).median_ms
            tf = flops / ms / 1e9
            ref = SDPA_TFLOPS.get(T)
            rows.append(dict(kernel=name, T=T, us=ms * 1e3, TFLOPs=tf,
                             pct=100 * tf / ref if ref else float("nan"),
                             ceiling=f"SDPA {ref:.0f} TFLOP/s" if ref else "-"))
    return rows


def bench_kvq_prefill(H, Hkv, d, rng, lengths, kv_types=("k3v3", "k4v4")):
    """T queries over T cached rows (a first chunk), f16 and coded, SDPA's FLOP count."""
    rows = []
    for T in lengths:
        q = _rand((T, H, d), np.float16, rng)
        proj = _rand((T, 2 * d * H + 2 * d * Hkv), np.float32, rng)
        out = cuda.device_array((T, H * d), np.float32)
        pos0 = cuda.to_device(np.zeros(1, np.int32))
        flops = 4.0 * H * T * T * d / 2
        n_inner = max(1, min(10, int(2e13 / flops)))
        kc, vc = _rand((Hkv, T, d), np.float16, rng), _rand((Hkv, T, d), np.float16, rng)
        cases = [("prefill_mma_w4", lambda s: launch_prefill_mma(q, kc, vc, pos0, proj, out, stream=s))]
        for kv_type in kv_types:
            (kb, vb), (k_row, v_row) = KV_TYPES[kv_type], vector_bytes(kv_type, d)
            tabs = KvqTables(d, kb, 1), KvqTables(d, vb, 2)
            norms = cuda.to_device((rng.uniform(5, 20, (Hkv, T)).astype(np.float16)).view(np.uint16))
            coded = [cuda.to_device(rng.integers(0, 256, (Hkv, T, row - 2), dtype=np.uint8)) for row in (k_row, v_row)]
            cases.append((f"kvq_prefill_{kv_type}", lambda s, c=coded, n=norms, t=tabs: kvq_attention_prefill(
                q, c[0], n, c[1], n, pos0, t[0], t[1], proj, out, stream=s)))
        for name, launch in cases:
            ms = time_graph(launch, n_inner=n_inner, reps=3 if flops > 1e12 else 10).median_ms
            tf = flops / ms / 1e9
            ref = SDPA_TFLOPS.get(T)
            rows.append(dict(kernel=name, T=T, us=ms * 1e3, TFLOPs=tf, pct=100 * tf / ref if ref else float("nan"),
                             ceiling=f"SDPA {ref:.0f} TFLOP/s" if ref else "-"))
    return rows


def _printed(rows: list[dict]) -> list[dict]:
    """Print a section's rows as soon as it is timed (a long run shows its progress), and return them."""
    for r in rows:
        size = f"T={r['T']}" if "T" in r else f"L={r['L']}"
        print(f"{r['kernel']:30s} {size:>9s} {r['us']:10.1f} {r.get('GBs', float('nan')):8.0f} "
              f"{r.get('TFLOPs', float('nan')):8.2f} {r['pct']:6.1f}  {r['ceiling']}"
              + (f"  splits {r['n_splits']}" if "n_splits" in r else ""), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--only", default="rope,decode,kvq,prefill")
    ap.add_argument("--prefill-lengths", default="512,2048,8192,32768")
    ap.add_argument("--mma", action="store_true", help="also time the fp16 tensor-core prefill")
    ap.add_argument("--kvq-types", default="k3v3,k4v4", help="kvq: the coded types")
    ap.add_argument("--kvq-lengths", default="8192,32768", help="kvq: cached tokens (multiples of 16)")
    ap.add_argument("--kvq-splits", default=str(KVQ_SPLITS), help="kvq: split-K blocks per KV head")
    ap.add_argument("--kvq-variants", default="lanes,tokens,mma", help="kvq: the partials")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args(argv)
    shape = SHAPES[args.model]
    rng = np.random.default_rng(0)
    parts = set(args.only.split(","))
    gpu = gpu_name()
    print(f"# {gpu}  model {args.model} {shape}")
    print(f"{'kernel':30s} {'shape':>9s} {'µs':>10s} {'GB/s':>8s} {'TFLOP/s':>8s} {'%ceil':>6s}  ceiling")
    rows = []
    if "rope" in parts:
        rows += _printed(bench_rope(**shape, rng=rng))
    if "decode" in parts:
        rows += _printed(bench_decode(**shape, rng=rng))
    if "kvq" in parts:
        ints = lambda text: tuple(int(x) for x in text.split(","))    # noqa: E731
        rows += _printed(bench_kvq_decode(**shape, rng=rng, kv_types=tuple(args.kvq_types.split(",")),
                                          lengths=ints(args.kvq_lengths), splits=ints(args.kvq_splits),
                                          variants=tuple(args.kvq_variants.split(","))))
    lengths = [int(x) for x in args.prefill_lengths.split(",")]
    if "prefill" in parts:
        rows += _printed(bench_prefill(**shape, rng=rng, mma=args.mma, lengths=lengths))
    if "kvq_prefill" in parts:
        rows += _printed(bench_kvq_prefill(**shape, rng=rng, lengths=lengths))
    append_jsonl(args.out, [dict(r, model=args.model, gpu=gpu, **shape) for r in rows])


if __name__ == "__main__":
    main()
