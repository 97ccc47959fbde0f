"""Records: building them from llama-bench rows and our runs, writing, reading, validating, naming folders."""
from __future__ import annotations

import json

import pytest

from benchmarks.records import (REQUIRED_FIELDS, BenchTest, find_record_files, ninfer_record, read_records,
                                run_folder_name, slug, write_records)


def test_llama_records_carry_the_required_fields(llama_records):
    recs = llama_records["9b"]
    assert len(recs) == 7
    for rec in recs:
        assert all(f in rec for f in REQUIRED_FIELDS)
        assert rec["engine"] == "llama.cpp" and rec["model"] == "9b" and rec["gpu"] == "NVIDIA H200"
        assert rec["llamacpp_build"] == "b8462 (29b28a9)" and rec["model_size_bytes"] == 9516533760
        assert rec["min_tps"] <= rec["median_tps"] <= rec["max_tps"] and rec["reps"] == 3
    by_test = {r["test"]: r for r in recs}
    assert by_test["tg128 @ d32768"]["median_tps"] == 161.322
    assert by_test["pp512"]["samples_tps"] == [6898.19, 8885.26, 8845.55]
    assert by_test["pp512"]["settings"]["n_ubatch"] == 512 and by_test["pp512"]["settings"]["flash_attn"] is True
    assert by_test["pp512"]["timestamp"] == "2026-11-30T19:07:13Z"


def test_ninfer_record_fields():
    ctx = {"model": "tiny", "gpu": "CPU x", "git_commit": "abc", "git_dirty": True, "backend": "cpu",
           "ceilings": None, "model_file": "q35-tiny.gguf", "model_size_bytes": 123}
    rec = ninfer_record(BenchTest(0, 16, 64), [10.0, 30.0, 20.0], ctx, settings={"kv_type": "f16"},
                        compile_seconds=1.5)
    assert rec["engine"] == "ninfer" and rec["test"] == "tg16 @ d64"
    assert (rec["median_tps"], rec["min_tps"], rec["max_tps"], rec["reps"]) == (20.0, 10.0, 30.0, 3)
    assert (rec["n_prompt"], rec["n_gen"], rec["n_depth"]) == (0, 16, 64)
    assert rec["git_dirty"] is True and rec["compile_seconds"] == 1.5 and rec["llamacpp_build"] is None
    assert rec["numba_cuda"] is None  # absent context fields are recorded as null, never invented


def test_write_read_roundtrip(tmp_path, llama_records, ninfer_9b_file):
    recs = llama_records["9b"] + read_records(ninfer_9b_file)
    path = write_records(tmp_path / "run" / "records.jsonl", recs)
    assert read_records(path) == json.loads(json.dumps(recs))
    write_records(path, recs[:2], append=True)
    assert len(read_records(path)) == len(recs) + 2
    write_records(path, recs[:1])
    assert len(read_records(path)) == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("git_commit"), "lacks required fields"),
    (lambda r: r.update(engine="vllm"), "engine 'vllm'"),
    (lambda r: r.update(samples_tps=[]), "empty samples_tps"),
])
def test_invalid_records_are_refused(tmp_path, llama_records, mutate, message):
    rec = dict(llama_records["9b"][0])
    mutate(rec)
    with pytest.raises(ValueError, match=message):
        write_records(tmp_path / "records.jsonl", [rec])
    assert not (tmp_path / "records.jsonl").exists()
    (tmp_path / "records.jsonl").write_text(json.dumps(llama_records["9b"][0]) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=f"records.jsonl:2.*{message}"):
        read_records(tmp_path / "records.jsonl")


def test_read_names_the_bad_line(tmp_path):
    (tmp_path / "records.jsonl").write_text("\n{not json\n")
    with pytest.raises(ValueError, match="records.jsonl:2: not JSON"):
        read_records(tmp_path / "records.jsonl")


def test_folder_names():
    assert slug("NVIDIA H200") == "nvidia-h200"
    assert slug("NVIDIA GeForce RTX 4090 D") == "nvidia-geforce-rtx-4090-d"
    assert slug("///") == "unknown"
    assert run_folder_name("2026-11-30", "NVIDIA H200", "9b") == "2026-11-30_nvidia-h200_9b"
    assert run_folder_name("2026-11-30", "cpu", "0.8b") == "2026-11-30_cpu_0.8b"


def test_find_record_files(tmp_path, llama_records):
    for name in ("b_run", "a_run"):
        write_records(tmp_path / name / "records.jsonl", llama_records["27b"])
    (tmp_path / "other.jsonl").write_text("")
    found = find_record_files(tmp_path)
    assert [f.parent.name for f in found] == ["a_run", "b_run"]
    assert find_record_files(found[0]) == [found[0]]
    with pytest.raises(FileNotFoundError):
        find_record_files(tmp_path / "missing")
