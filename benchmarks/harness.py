"""``ninfer bench``: our engine against llama.cpp's llama-bench on the same GGUF file, same tests.

For each model: llama-bench runs (``-fa 1 -ngl 99 -o jsonl``, prefill with ``-ub 512,1024,2048`` keeping
llama.cpp's best micro-batch per test), then our engine runs the identical tests: random-token prompts of
the same lengths, and decode timed like llama-bench (n_gen one-token steps after an untimed depth fill).
Each test gets one untimed warm-up run first, so JIT compilation and graph capture never land in a timed
repetition; the engine's compile time is recorded on its own. Records go to
results/<date>_<gpu>_<model>/records.jsonl (see records.py), plots and a table beside them (plot.py).

--gpus splits our model by layers over GPUs (as every ninfer verb does) and runs llama-bench on the same
devices with -sm layer (llamacpp.llama_devices); without it both run on GPU 0 alone.

Without a GPU the same harness runs the CPU reference backend on the tiny model (pp128, pp512, tg16) and
llama.cpp's CPU build when one exists; such records say backend "cpu" and the device is the CPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from benchmarks import llamacpp
from benchmarks.ceilings import ModelCost, measure_ceilings, null_ceilings, roofline
from benchmarks.records import (RECORDS_FILE, BenchTest, best_ubatch, llama_record,
                                ninfer_record, parse_tests, read_llama_bench_jsonl, run_folder_name,
                                write_records)
from ninfer_numba.config import KV_CACHE_TYPES, KVQ_PARTIALS

GPU_TESTS = "pp512,pp2048,pp8192,pp32768,tg128,tg128@d8192,tg128@d32768"
CPU_TESTS = "pp128,pp512,tg16"
SHAPES = ("tiny", "0.8b", "2b", "4b", "9b", "27b")
UBATCH_SIZES = "512,1024,2048"
LLAMACPP_KV_TYPES = {"f16": "f16"}   # ours -> llama.cpp's -ctk/-ctv: the coded ones (k3v3 ...) it has not
LLAMACPP_CACHE_CHOICES = ("f16", "q8_0", "q4_0")
RESULTS_DIR = llamacpp.REPO_ROOT / "results"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ninfer bench``."""
    parser.add_argument("--models", default=None,
                        help=f"comma-separated shapes ({', '.join(SHAPES)}) or .gguf paths "
                             "(default: 9b with a GPU, tiny without)")
    parser.add_argument("--tests", default=None,
                        help=f"comma-separated llama-bench tests (default with a GPU: {GPU_TESTS}; without: {CPU_TESTS})")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per test (>= 1; protocol: >= 3)")
    parser.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--kv-type", default="f16", choices=KV_CACHE_TYPES,
                        help="our KV cache type (llama.cpp runs --llamacpp-kv-type, f16 unless given)")
    parser.add_argument("--kvq-partial", default="auto", choices=KVQ_PARTIALS,
                        help="our coded cache's decode partial (EngineConfig.kvq_partial)")
    parser.add_argument("--llamacpp-kv-type", choices=LLAMACPP_CACHE_CHOICES, default=None,
                        help="llama.cpp's -ctk/-ctv (default: ours where it has it, else f16)")
    parser.add_argument("--gemm", choices=["auto", "w8a16", "mma", "dp4a"], default="auto",
                        help="our prefill GEMM: w8a16 (Hopper, f16 activations), mma or dp4a (int8 activations)")
    parser.add_argument("--prefill-graphs", choices=["on", "off"], default="on",
                        help="replay repeated prefill chunk lengths from CUDA graphs (off: every launch from Python)")
    parser.add_argument("--pdl", choices=["on", "off"], default="on",
                        help="our decode-step kernels launched programmatically (Hopper; kernels/pdl.py)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default results/<date>_<gpu>_<model>/; one subfolder per model "
                             "when several are given)")
    parser.add_argument("--model-dir", type=Path, default=Path("models"),
                        help="where synthetic model files are found or written (default models/)")
    parser.add_argument("--llama-bench", type=Path, default=None,
                        help="an existing llama-bench binary (or $LLAMA_BENCH); default: build or reuse the cache")
    parser.add_argument("--skip-llamacpp", action="store_true", help="run only our engine")
    parser.add_argument("--gpus", default="",
                        help="split our model by layers over these GPUs (a count or ids; 0,0: two shards on one) "
                             "and run llama.cpp with -sm layer over the same distinct devices (default: GPU 0)")


def model_path(spec: str, model_dir: Path) -> tuple[str, Path]:
    """(label, file) of a --models entry: a shape ('9b' -> model_dir/q35-9b.gguf) or a .gguf path."""
    if spec.endswith(".gguf"):
        return Path(spec).stem, Path(spec)
    if spec not in SHAPES:
        raise ValueError(f"unknown model {spec!r}: use one of {', '.join(SHAPES)} or a path to a .gguf file")
    return spec, model_dir / f"q35-{spec}.gguf"


def ensure_model(spec: str, model_dir: Path) -> tuple[str, Path]:
    """The model file, written with ``make-model`` (vocab-less, seed 0) when a synthetic one is missing."""
    label, path = model_path(spec, model_dir)
    if path.is_file():
        return label, path
    if spec.endswith(".gguf"):
        raise FileNotFoundError(f"model file {path} does not exist")
    partial = path.with_name(path.name + ".partial")
    log(f"writing synthetic model {path} (make-model --shape {spec} --no-vocab)")
    cmd = [sys.executable, "-m", "ninfer_numba", "make-model", "--shape", spec, "--out", str(partial), "--no-vocab"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    os.replace(partial, path)  # only a complete file ever has the final name
    return label, path


def llamacpp_kv_type(ours: str, asked: str | None) -> str:
    """llama.cpp's cache type for a run: the one asked for, else ours where llama.cpp has it, else f16."""
    if asked is not None:
        return asked
    if ours not in LLAMACPP_KV_TYPES:
        log(f"llama.cpp has no {ours!r} KV cache; it runs with f16 (recorded in its settings)")
    return LLAMACPP_KV_TYPES.get(ours, "f16")


def llamacpp_devices(gpus: str, backend: str) -> llamacpp.LlamaDevices | None:
    """llama-bench's GPUs for our --gpus: the plain runner's GPU 0 when unset; None on a CPU run."""
    if backend != "cuda":
        if gpus:
            raise ValueError("--gpus splits the model over GPUs: it needs the cuda backend")
        return None
    from ninfer_numba.engine.shard_plan import parse_gpus
    return llamacpp.llama_devices(parse_gpus(gpus) if gpus else [0], os.environ.get("CUDA_VISIBLE_DEVICES"))


def llamacpp_commands(binary: Path, model: Path, tests: list[BenchTest], reps: int,
                      lc_kv: str, devices: llamacpp.LlamaDevices | None = None) -> list[list[str]]:
    """llama-bench invocations covering ``tests`` exactly: prefill tests grouped by depth (with the
    micro-batch sweep), decode tests grouped by n_gen (one -d list); ``devices`` adds its split mode."""
    base = [str(binary), "-m", str(model), "-fa", "1", "-ngl", "99", "-r", str(reps), "-o", "jsonl", "--progress"]
    base += devices.args() if devices is not None else []
    base += ["-ctk", lc_kv, "-ctv", lc_kv]
    cmds = []
    by_depth: dict[int, list[int]] = {}
    by_gen: dict[int, list[int]] = {}
    for t in tests:
        if t.kind == "pp":
            by_depth.setdefault(t.n_depth, []).append(t.n_prompt)
        else:
            by_gen.setdefault(t.n_gen, []).append(t.n_depth)
    for depth, prompts in by_depth.items():
        cmds.append(base + ["-p", ",".join(map(str, prompts)), "-n", "0", "-d", str(depth), "-ub", UBATCH_SIZES])
    for n_gen, depths in by_gen.items():
        cmds.append(base + ["-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths))])
    return cmds


def run_llamacpp(binary: Path, model: Path, tests: list[BenchTest], reps: int, lc_kv: str,
                 raw_path: Path, devices: llamacpp.LlamaDevices | None = None) -> list[dict]:
    """Run llama-bench with cache type ``lc_kv`` on ``devices`` (None: as the environment says); its JSONL
    goes to ``raw_path`` untouched; returns the best-micro-batch rows."""
    rows = []
    env = devices.env(os.environ) if devices is not None else None
    for cmd in llamacpp_commands(binary, model, tests, reps, lc_kv, devices):
        shown = f"CUDA_VISIBLE_DEVICES={devices.visible} " if devices is not None else ""
        log(f"{shown}llama-bench " + " ".join(cmd[1:]))
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        with open(raw_path, "a") as f:
            f.write(out.stdout)
        if out.returncode != 0:
            raise RuntimeError(f"llama-bench exited with {out.returncode} (its log is above)")
        rows += read_llama_bench_jsonl(out.stdout)
    wanted = {t.name for t in tests}
    best = [r for r in best_ubatch(rows)
            if BenchTest(r["n_prompt"], r["n_gen"], r["n_depth"]).name in wanted]
    for r in best:
        ub = f" (ub {r['n_ubatch']})" if r["n_gen"] == 0 else ""
        log(f"llama.cpp {BenchTest(r['n_prompt'], r['n_gen'], r['n_depth']).name}: "
            f"{statistics.median(r['samples_ts']):.1f} t/s{ub}")
    return best


def time_one(llm, test: BenchTest, seed: int) -> float:
    """Seconds of one repetition of ``test`` on our engine (llama-bench semantics)."""
    if test.kind == "pp":
        if test.n_depth:
            raise ValueError(f"{test.name}: prefill after a depth fill is not supported by the engine API")
        return llm.bench_prefill(test.n_prompt, seed=seed)
    return llm.bench_decode(test.n_gen, test.n_depth, seed=seed)


def kernel_start_settings() -> dict:
    """How the kernels of the load just done came to be: compiled here (a cold start) or read from the
    on-disk cache (warm); both when the cache held some of them."""
    from ninfer_numba.kernels.kernel_cache import cache_stats

    st = cache_stats()
    start = "warm" if st["compiled"] == 0 else "cold" if st["loaded"] == 0 else "partly warm"
    log(f"kernels: {st['compiled']} specializations compiled, {st['loaded']} read from {st['cache_dir']}")
    return {"kernel_start": start, "kernels_compiled_at_load": st["compiled"], "kernels_loaded_at_load": st["loaded"]}


def run_ninfer(model: Path, tests: list[BenchTest], reps: int, backend: str, kv_type: str,
               gemm: str, prefill_graphs: bool = True, pdl: bool = True,
               gpus: str = "", kvq_partial: str = "auto"
               ) -> tuple[list[tuple[BenchTest, list[float], dict, float]], dict]:
    """Our engine on every test: (test, samples_tps, settings, compile_seconds) per test, and describe()."""
    from ninfer_numba import LLM

    kwargs = {"kv_type": kv_type} if kv_type != "f16" else {}
    if gpus:
        kwargs["gpus"] = gpus
    if gemm != "auto":
        kwargs["gemm"] = gemm
    if kvq_partial != "auto":
        kwargs["kvq_partial"] = kvq_partial
    if not prefill_graphs and backend == "cuda":
        kwargs["prefill_graphs"] = False
    if not pdl and backend == "cuda":
        kwargs["pdl"] = False
    t0 = time.perf_counter()
    llm = LLM(model, backend=backend, max_seq=max(t.context for t in tests), **kwargs)
    load_s = time.perf_counter() - t0
    described = llm.describe()
    log(f"ninfer loaded {model.name} on {llm.backend} in {load_s:.1f} s (compile {llm.compile_seconds:.1f} s)")
    if backend == "cuda":
        described.update(kernel_start_settings())
    results = []
    for test in tests:
        before = llm.compile_seconds
        time_one(llm, test, seed=reps)           # warm-up: first-call JIT and graph capture happen here
        warm_compile = llm.compile_seconds - before
        samples = []
        for rep in range(reps):
            seconds = time_one(llm, test, seed=rep)
            samples.append(test.n_tokens / seconds)
            log(f"ninfer {test.name} rep {rep + 1}/{reps}: {samples[-1]:.1f} t/s")
        timed_compile = llm.compile_seconds - before - warm_compile
        if timed_compile > 0:
            log(f"warning: {timed_compile:.2f} s of compilation happened inside timed repetitions of {test.name}")
        settings = {**described, "load_seconds": round(load_s, 3), "warmup_compile_seconds": warm_compile,
                    "timed_compile_seconds": timed_compile, "warmup_runs": 1}
        results.append((test, samples, settings, llm.compile_seconds))
    return results, described


def output_folder(args: argparse.Namespace, device: str, label: str, n_models: int) -> Path:
    name = run_folder_name(date.today().isoformat(), device, label)
    if args.out is not None:
        return args.out if n_models == 1 else args.out / name
    folder, i = RESULTS_DIR / name, 2
    while (folder / RECORDS_FILE).exists():  # a second run on the same day gets its own folder
        folder, i = RESULTS_DIR / f"{name}-{i}", i + 1
    return folder


def bench_model(spec: str, args: argparse.Namespace, tests: list[BenchTest], backend: str, machine: dict,
                ceilings: dict, binary: Path | None, devices: llamacpp.LlamaDevices | None = None) -> Path:
    """Benchmark one model with both engines (llama.cpp on ``devices``); returns the records file."""
    label, path = ensure_model(spec, args.model_dir)
    cost = ModelCost.from_gguf(path)
    gpu_name = machine["gpu"] or "unknown GPU"   # nvidia-smi may be missing where numba still sees a GPU
    if args.gpus:   # the device label carries the split, so titles, tables and the folder name show it
        gpu_name = f"{gpu_name} (gpus {args.gpus})"
    gpus = args.gpus if backend == "cuda" else None      # every record: "" is the plain runner on GPU 0
    folder = output_folder(args, gpu_name if backend == "cuda" else "cpu", label, len(args.models.split(",")))
    folder.mkdir(parents=True, exist_ok=True)
    context = {**machine, "gpu": gpu_name if backend == "cuda" else f"CPU {machine['cpu']}",
               "model": label, "model_file": path.name, "model_size_bytes": cost.model_size_bytes,
               "backend": backend, "ceilings": ceilings}
    records, build = [], None
    if binary is not None:
        log(f"{label}: llama-bench ({llamacpp.LABEL}) on {path}")
        raw = folder / "llamacpp_raw.jsonl"
        raw.unlink(missing_ok=True)
        lc_kv = llamacpp_kv_type(args.kv_type, args.llamacpp_kv_type)
        for row in run_llamacpp(binary, path, tests, args.reps, lc_kv, raw, devices):
            rec = {**llama_record(row, context), "gpus": gpus}
            if devices is not None:   # what we asked for, and llama-bench's own word on its split
                rec["settings"].update(device_selection=devices.as_settings(), split_mode=row.get("split_mode"))
            rec["roofline"] = roofline(BenchTest(row["n_prompt"], row["n_gen"], row["n_depth"]),
                                       rec["median_tps"], cost, ceilings, lc_kv)
            records.append(rec)
            build = rec["llamacpp_build"]
    log(f"{label}: ninfer ({backend}) on {path}")
    results, described = run_ninfer(path, tests, args.reps, backend, args.kv_type, args.gemm,
                                    args.prefill_graphs == "on", args.pdl == "on", args.gpus, args.kvq_partial)
    for test, samples, settings, compile_s in results:
        rec = {**ninfer_record(test, samples, context, settings=settings, compile_seconds=compile_s,
                               llamacpp_build=build), "gpus": gpus}
        rec["roofline"] = roofline(test, rec["median_tps"], cost, ceilings, described.get("kv_type", args.kv_type))
        records.append(rec)
    out = write_records(folder / RECORDS_FILE, records)
    (folder / "model_cost.json").write_text(json.dumps(cost.as_dict(), indent=1) + "\n")
    log(f"{label}: wrote {len(records)} records to {out}")
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of ``ninfer bench``; returns the exit status (2 for bad options or missing inputs)."""
    missing = [m for m in ("matplotlib",) if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: the benchmark harness needs {', '.join(missing)}: pip install -e '.[bench]' "
              "(make bench installs it)", file=sys.stderr)
        return 2
    from ninfer_numba.kernels.numba_env import gpu_available
    from benchmarks.machine import machine_info

    backend = args.backend if args.backend != "auto" else ("cuda" if gpu_available() else "cpu")
    args.models = args.models or ("9b" if backend == "cuda" else "tiny")
    try:
        tests = parse_tests(args.tests or (GPU_TESTS if backend == "cuda" else CPU_TESTS))
        if args.reps < 1:
            raise ValueError("--reps must be >= 1")
        if any(t.kind == "pp" and t.n_depth for t in tests):
            raise ValueError("prefill tests after a depth fill (ppN@dD) are not supported; use ppN or tgN@dD")
        devices = llamacpp_devices(args.gpus, backend)      # a bad --gpus fails before any measurement
        if backend == "cpu":
            log("CPU run: the NumPy reference backend (these numbers say nothing about GPU speed)")
        machine = machine_info()
        ceilings = measure_ceilings() if backend == "cuda" else null_ceilings("CPU run: no GPU ceilings")
        log(f"ceilings: copy {ceilings['copy_gbps']} GB/s, int8 GEMM {ceilings['int8_tops']} TOPS "
            f"({ceilings['method'] or ceilings['note']})")
        binary = find_baseline(args, backend)
        files = [bench_model(spec.strip(), args, tests, backend, machine, ceilings, binary, devices)
                 for spec in args.models.split(",") if spec.strip()]
    except (ValueError, FileNotFoundError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from benchmarks import plot
    for f in files:
        plot.plot_run(f)
        print(plot.markdown_table(plot.load(f)))
        written = sorted(p.name for p in f.parent.iterdir() if p.is_file())
        log(f"{f.parent}: {', '.join(written)}")
    if any(RESULTS_DIR in f.parents for f in files):
        plot.write_results_readme(RESULTS_DIR)
        log(f"updated {RESULTS_DIR / 'README.md'} (results/ does not count as a dirty tree in later records)")
    return 0


def find_baseline(args: argparse.Namespace, backend: str) -> Path | None:
    """llama-bench to compare with: built if missing on a GPU machine; on a CPU run only an existing build."""
    if args.skip_llamacpp:
        log("llama.cpp skipped (--skip-llamacpp)")
        return None
    if backend == "cuda":
        return llamacpp.ensure_llama_bench(args.llama_bench, llamacpp.DEFAULT_CACHE)
    binary = llamacpp.find_llama_bench(args.llama_bench, llamacpp.DEFAULT_CACHE, cuda_arch=None)
    if binary is None:
        log("llama.cpp skipped: no CPU build of llama-bench (python -m benchmarks.llamacpp build --cpu, "
            "or pass --llama-bench / set LLAMA_BENCH)")
    return binary
