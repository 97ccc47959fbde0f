"""Fixtures of the harness tests: the real llama-bench JSONL recorded on one H200 (build 8462) and a
records file of our engine written for these tests (illustrative numbers, marked as such inside)."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.records import llama_record, read_llama_bench_jsonl

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA_BENCH_FILES = ("pp_9b.jsonl", "tg_9b.jsonl", "pp_27b.jsonl", "tg_27b.jsonl")


@pytest.fixture(scope="session")
def llama_rows() -> dict[str, list[dict]]:
    """{'9b': rows, '27b': rows}: prefill and decode rows of each model."""
    rows: dict[str, list[dict]] = {}
    for name in LLAMA_BENCH_FILES:
        model = name.split("_")[1].removesuffix(".jsonl")
        rows.setdefault(model, []).extend(read_llama_bench_jsonl(FIXTURES / name))
    return rows


def context_for(model: str, row: dict) -> dict:
    """Record context of a run reconstructed from a llama-bench row (the machine it names)."""
    return {"model": model, "gpu": row["gpu_info"], "cpu": row["cpu_info"], "backend": "cuda",
            "model_file": row["model_filename"], "model_size_bytes": row["model_size"],
            "git_commit": "0" * 40, "git_dirty": False,
            "ceilings": {"copy_gbps": 4250.0, "int8_tops": 918.0, "method": "fixture", "note": "fixture"}}


@pytest.fixture(scope="session")
def llama_records(llama_rows) -> dict[str, list[dict]]:
    return {model: [llama_record(r, context_for(model, r)) for r in rows] for model, rows in llama_rows.items()}


@pytest.fixture(scope="session")
def ninfer_9b_file() -> Path:
    return FIXTURES / "ninfer_9b.jsonl"
