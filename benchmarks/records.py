"""Benchmark records: one JSON line per (engine, test) in results/<date>_<gpu>_<model>/records.jsonl.

External tooling relies on these field names: engine ("ninfer" | "llama.cpp"), test (llama-bench's names:
"pp512", "tg128", "tg128 @ d32768"), model ("9b"), gpu (device name), median_tps, samples_tps, git_commit,
git_dirty. Every record also carries min_tps/max_tps, n_prompt/n_gen/n_depth, reps, backend, driver, cuda,
numba_cuda, numpy, cpu, llamacpp_build, model_file, model_size_bytes, settings, compile_seconds, ceilings,
roofline and timestamp. Plots and tables are derived from records only.

This module also reads llama-bench's ``-o jsonl`` output and keeps, per test, the micro-batch size that
gave llama.cpp its best median (a fair baseline takes llama.cpp's best of ``-ub 512,1024,2048``).
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

RECORDS_FILE = "records.jsonl"
ENGINES = ("ninfer", "llama.cpp")
REQUIRED_FIELDS = ("engine", "test", "model", "gpu", "median_tps", "samples_tps", "git_commit", "git_dirty")
LLAMA_BENCH_FIELDS = ("build_commit", "build_number", "model_size", "n_prompt", "n_gen", "n_depth", "n_ubatch",
                      "samples_ts")
# Context fields copied from the machine description into every record.
MACHINE_FIELDS = ("gpu", "driver", "cuda", "compute_cap", "cpu", "numba", "numba_cuda", "numpy", "llvmlite",
                  "cuda_bindings", "python", "git_commit", "git_dirty")

_TEST_RE = re.compile(r"^(pp|tg)(\d+)(?:\s*@\s*d(\d+))?$")


@dataclass(frozen=True)
class BenchTest:
    """One llama-bench test: a prefill of n_prompt tokens or n_gen decode steps, after n_depth tokens of context."""
    n_prompt: int
    n_gen: int
    n_depth: int = 0

    @property
    def kind(self) -> str:
        return "pp" if self.n_gen == 0 else "tg"

    @property
    def n_tokens(self) -> int:
        """Tokens per repetition; llama-bench's t/s is this over the timed seconds."""
        return self.n_prompt + self.n_gen

    @property
    def context(self) -> int:
        """Cache positions the test needs."""
        return self.n_depth + self.n_prompt + self.n_gen

    @property
    def name(self) -> str:
        return test_name(self.n_prompt, self.n_gen, self.n_depth)


def test_name(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    """llama-bench's test name: 'pp512', 'tg128', 'tg128 @ d32768' (a test is prefill xor decode)."""
    if (n_prompt > 0) == (n_gen > 0):
        raise ValueError(f"a test is either a prefill or a decode, got n_prompt={n_prompt} n_gen={n_gen}")
    base = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    return f"{base} @ d{n_depth}" if n_depth else base


def parse_test(spec: str) -> BenchTest:
    """'pp512' | 'tg128' | 'tg128@d8192' | 'tg128 @ d8192' -> BenchTest."""
    m = _TEST_RE.match(spec.strip())
    if not m or int(m.group(2)) == 0:
        raise ValueError(f"bad test {spec!r}: expected ppN, tgN or tgN@dD with N > 0 (e.g. pp512, tg128@d8192)")
    n, depth = int(m.group(2)), int(m.group(3) or 0)
    return BenchTest(n, 0, depth) if m.group(1) == "pp" else BenchTest(0, n, depth)


def parse_tests(specs: str) -> list[BenchTest]:
    """A comma-separated list of tests, duplicates removed, order kept."""
    tests = [parse_test(s) for s in specs.split(",") if s.strip()]
    if not tests:
        raise ValueError("no tests given")
    return list(dict.fromkeys(tests))


def read_llama_bench_jsonl(source: str | Path) -> list[dict]:
    """Rows of llama-bench ``-o jsonl`` output, from a file path or the text itself; non-JSON lines (a
    build's log noise) are an error, named by line number."""
    text = Path(source).read_text() if isinstance(source, Path) else source
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"llama-bench output line {i} is not JSON: {e}: {line[:80]!r}") from None
        missing = [f for f in LLAMA_BENCH_FIELDS if f not in row]
        if missing:
            raise ValueError(f"llama-bench output line {i} lacks {missing}")
        rows.append(row)
    return rows


def median_tps(row: dict) -> float:
    return float(statistics.median(row["samples_ts"]))


def best_ubatch(rows: list[dict]) -> list[dict]:
    """Per test (and KV type), the row whose micro-batch gave the highest median t/s, with the medians of
    all tried micro-batches under ``ubatch_tps`` ({n_ubatch: median}); first-seen test order is kept."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["n_prompt"], row["n_gen"], row["n_depth"], row.get("type_k"), row.get("type_v"))
        groups.setdefault(key, []).append(row)
    best = []
    for group in groups.values():
        winner = dict(max(group, key=median_tps))
        winner["ubatch_tps"] = {int(r["n_ubatch"]): round(median_tps(r), 3) for r in group}
        best.append(winner)
    return best


# Builds whose number alone misleads: 8475 is the source llama-cpp-python 0.3.18 vendors, 13 commits after
# the 8462 baseline (none touching qwen35).
BUILD_NOTES = {8475: "b8462 + 13"}


def llamacpp_build_label(row: dict) -> str:
    """'b8462 (29b28a9)' or 'b8475 (b8462 + 13, 49bfdde)' from a llama-bench row."""
    note = BUILD_NOTES.get(int(row["build_number"]))
    return f"b{row['build_number']} ({note + ', ' if note else ''}{row['build_commit']})"


def _stats(samples: list[float]) -> dict:
    samples = [float(s) for s in samples]
    return {"median_tps": statistics.median(samples), "samples_tps": samples,
            "min_tps": min(samples), "max_tps": max(samples), "reps": len(samples)}


def _common(context: dict, test: BenchTest) -> dict:
    """Fields shared by both engines' records; ``context`` holds model, model_file, model_size_bytes,
    backend, ceilings and the machine fields (see MACHINE_FIELDS)."""
    rec = {"test": test.name, "model": context["model"],
           "n_prompt": test.n_prompt, "n_gen": test.n_gen, "n_depth": test.n_depth}
    rec.update({k: context.get(k) for k in MACHINE_FIELDS})
    rec.update({k: context.get(k) for k in ("backend", "model_file", "model_size_bytes", "ceilings")})
    rec["timestamp"] = context.get("timestamp") or datetime.now(timezone.utc).isoformat(timespec="seconds")
    return rec


def llama_record(row: dict, context: dict) -> dict:
    """A record for one (best-micro-batch) llama-bench row."""
    test = BenchTest(int(row["n_prompt"]), int(row["n_gen"]), int(row["n_depth"]))
    settings = {k: row.get(k) for k in ("n_batch", "n_ubatch", "flash_attn", "type_k", "type_v", "n_gpu_layers",
                                       "n_threads", "backends", "use_mmap", "model_type", "model_filename")}
    if "ubatch_tps" in row:
        settings["ubatch_tps"] = {str(k): v for k, v in row["ubatch_tps"].items()}  # JSON keys are strings
    rec = {"engine": "llama.cpp", **_common(context, test), **_stats(row["samples_ts"]),
           "llamacpp_build": llamacpp_build_label(row), "settings": settings, "compile_seconds": None}
    rec["model_size_bytes"] = context.get("model_size_bytes") or row["model_size"]
    rec["timestamp"] = row.get("test_time") or rec["timestamp"]
    return rec


def ninfer_record(test: BenchTest, samples_tps: list[float], context: dict, *, settings: dict,
                  compile_seconds: float, llamacpp_build: str | None = None) -> dict:
    """A record for one of our tests; ``settings`` is LLM.describe() plus harness knobs."""
    return {"engine": "ninfer", **_common(context, test), **_stats(samples_tps),
            "llamacpp_build": llamacpp_build, "settings": settings, "compile_seconds": compile_seconds}


def validate_record(rec: dict, where: str = "record") -> dict:
    missing = [f for f in REQUIRED_FIELDS if f not in rec]
    if missing:
        raise ValueError(f"{where} lacks required fields {missing}")
    if rec["engine"] not in ENGINES:
        raise ValueError(f"{where}: engine {rec['engine']!r} is not one of {ENGINES}")
    if not rec["samples_tps"] or not isinstance(rec["median_tps"], (int, float)):
        raise ValueError(f"{where}: empty samples_tps or non-numeric median_tps")
    return rec


def write_records(path: Path, records: list[dict], *, append: bool = False) -> Path:
    """Write records as JSON lines (validated first, so a bad record never reaches the file)."""
    for i, rec in enumerate(records):
        validate_record(rec, f"record {i}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=False) + "\n")
    return path


def read_records(path: Path) -> list[dict]:
    """Records from a records.jsonl file, each validated; errors name the file and line."""
    recs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON: {e}") from None
            recs.append(validate_record(rec, f"{path}:{i}"))
    return recs


def find_record_files(target: Path) -> list[Path]:
    """records.jsonl files at ``target``: the file itself, or every one below a folder (sorted)."""
    target = Path(target)
    if target.is_file():
        return [target]
    if not target.is_dir():
        raise FileNotFoundError(f"{target} is neither a records file nor a folder")
    return sorted(target.rglob(RECORDS_FILE))


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': safe in folder names."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unknown"


def run_folder_name(date: str, device: str, model: str) -> str:
    """results/<date>_<gpu>_<model>: '2026-11-30_nvidia-h200_9b'."""
    return f"{date}_{slug(device)}_{slug(model)}"
