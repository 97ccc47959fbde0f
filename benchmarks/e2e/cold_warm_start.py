"""Cold and warm start of the CUDA backend: the same model loaded by two fresh processes sharing one kernel
cache folder, the first with it empty.

    python -m benchmarks.e2e.cold_warm_start --model M.gguf [--cache-dir DIR]

Each process reports LLM.load_seconds (read + repack + upload + compile + graph capture) and
compile_seconds (the warm-up forwards that compile every kernel, and the captures). The first process
compiles everything; the second finds the module-level kernels on disk (kernels/numba_env.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PROBE = ("import json, sys, time; t = time.perf_counter(); from ninfer_numba import LLM; "
         "llm = LLM(sys.argv[1], backend='cuda', max_seq=256); "
         "print(json.dumps({'process_s': time.perf_counter() - t, 'load_s': llm.load_seconds, "
         "'compile_s': llm.compile_seconds}))")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache-dir", default=None, help="kernel cache folder (default: a fresh temporary one)")
    a = ap.parse_args(argv)
    cache = a.cache_dir or tempfile.mkdtemp(prefix="ninfer-kernel-cache-")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, NINFER_KERNEL_CACHE="1")
    report = {"model": a.model, "cache_dir": cache}
    for phase in ("cold", "warm"):
        out = subprocess.run([sys.executable, "-c", PROBE, a.model], env=env, check=True, capture_output=True,
                             text=True).stdout.strip().splitlines()[-1]
        report[phase] = json.loads(out)
        print(f"{phase}: {out}", file=sys.stderr, flush=True)
    report["cache_files"] = sum(len(f) for _, _, f in os.walk(cache))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
