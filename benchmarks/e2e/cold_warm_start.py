"""Cold and warm start of the CUDA backend: the same model started by fresh processes sharing one kernel
cache folder (kernels/kernel_cache.py), the first with the folder empty.

    python -m benchmarks.e2e.cold_warm_start --model M.gguf [--warm-runs 2] [--prompt-tokens 512]
        [--gen-tokens 32] [--cache-dir DIR] [--out F.json]

Each process reports, in seconds: import (the package and numba), load (LLM(): read + repack + upload +
the warm-up forwards that compile or load every kernel + graph capture), of which compile (the warm-up
forwards and captures alone), the first generate call (a 512-token prompt then 32 greedy tokens, by default) and a second
identical call; and how many kernel specializations it compiled and how many it loaded from disk. The cold
process compiles everything; a warm one should compile nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time



def probe(model: str, prompt_tokens: int, gen_tokens: int) -> dict:
    """One start, measured from inside the process that starts."""
    t0 = time.perf_counter()
    import numpy as np

    from ninfer_numba import LLM, SamplingParams
    from ninfer_numba.kernels.kernel_cache import cache_stats
    t_import = time.perf_counter()
    llm = LLM(model, backend="cuda", max_seq=prompt_tokens + gen_tokens + 8)
    t_load = time.perf_counter()
    after_load = cache_stats()
    ids = np.random.default_rng(0).integers(0, llm.config.n_vocab, prompt_tokens).tolist()
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    calls = []
    for _ in range(2):
        t = time.perf_counter()
        out = llm.generate(ids, params)
        calls.append(time.perf_counter() - t)
    assert out.completion_tokens == gen_tokens, out
    end = cache_stats()
    return {"import_s": t_import - t0, "load_s": t_load - t_import, "compile_s": llm.compile_seconds,
            "first_generate_s": calls[0], "second_generate_s": calls[1], "total_s": time.perf_counter() - t0,
            "kernels_compiled_at_load": after_load["compiled"], "kernels_loaded_at_load": after_load["loaded"],
            "kernels_compiled": end["compiled"], "kernels_loaded": end["loaded"], "cache_dir": end["cache_dir"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--warm-runs", type=int, default=2, help="warm processes after the cold one (default 2)")
    ap.add_argument("--cache-dir", default=None, help="kernel cache folder (default: a fresh temporary one)")
    ap.add_argument("--out", default=None, help="also write the report here (JSON)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe:
        print(json.dumps(probe(a.model, a.prompt_tokens, a.gen_tokens)))
        return 0
    cache = a.cache_dir or tempfile.mkdtemp(prefix="ninfer-kernel-cache-")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, NINFER_KERNEL_CACHE="1")
    runs = []
    for i in range(1 + a.warm_runs):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e.cold_warm_start", "--probe", "--model", a.model,
                               "--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        run = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_wall_s": time.perf_counter() - t}
        runs.append(run)
        label = "cold" if i == 0 else f"warm {i}"
        print(f"{label}: process {run['process_wall_s']:.1f} s, load {run['load_s']:.1f} s (compile "
              f"{run['compile_s']:.1f} s), first generate {run['first_generate_s']:.2f} s, second "
              f"{run['second_generate_s']:.2f} s; kernels compiled {run['kernels_compiled']}, "
              f"loaded from disk {run['kernels_loaded']}", file=sys.stderr, flush=True)
    warm = runs[1:]
    report = {"model": a.model, "cache_dir": cache, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
              "cold": runs[0], "warm": warm,
              "warm_median": {k: statistics.median(r[k] for r in warm) for k in runs[0]
                              if isinstance(runs[0][k], (int, float))} if warm else None,
              "cache_files": sum(len(f) for _, _, f in os.walk(cache)),
              "cache_bytes": sum(os.path.getsize(os.path.join(d, n)) for d, _, f in os.walk(cache) for n in f)}
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
