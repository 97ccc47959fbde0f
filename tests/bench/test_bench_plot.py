"""Plots, tables and the results README, from the real llama-bench records plus our fixture records."""
from __future__ import annotations

import matplotlib
import pytest

from benchmarks import plot
from benchmarks.records import read_records, write_records

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def results(tmp_path, llama_records, ninfer_9b_file):
    """tmp/results with a 9B run (both engines) and a 27B run (llama.cpp only)."""
    root = tmp_path / "results"
    write_records(root / "2026-11-30_nvidia-h200_9b" / "records.jsonl",
                  llama_records["9b"] + read_records(ninfer_9b_file))
    write_records(root / "2026-11-29_nvidia-h200_27b" / "records.jsonl", llama_records["27b"])
    return root


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 2000


def test_agg_backend():
    assert matplotlib.get_backend().lower() == "agg"


def test_paired_and_speedup(results):
    rows = plot.paired(plot.load(results / "2026-11-30_nvidia-h200_9b"))
    assert [r["test"] for r in rows] == ["pp512", "pp2048", "pp8192", "pp32768",
                                         "tg128", "tg128 @ d8192", "tg128 @ d32768"]
    assert plot.speedup(rows[0]) == pytest.approx(9350.0 / 8845.55)
    assert plot.speedup(rows[4]) == pytest.approx(241.0 / 187.564)
    only_llama = plot.paired(plot.load(results / "2026-11-29_nvidia-h200_27b"))
    assert all(plot.speedup(r) is None and r["ninfer"] is None for r in only_llama)


def test_markdown_table(results):
    table = plot.markdown_table(plot.load(results / "2026-11-30_nvidia-h200_9b"))
    lines = table.splitlines()
    assert lines[0].startswith("device NVIDIA H200 · backend cuda")
    assert "llama.cpp b8462 (29b28a9)" in lines[0] and "model 9b (q35-9b.gguf, 9.52 GB)" in lines[0]
    assert "| 9b | pp512 | 8,845.5 (ub 512) | 9,350.0 | 1.06x | 14% (129.4 int8 TOPS) | 41.5 |" in lines
    tg = next(line for line in lines if "| tg128 @ d32768 |" in line)
    assert "161.3 |" in tg and "(ub" not in tg and f"{215.0 / 161.322:.2f}x" in tg


def test_plot_run_writes_pngs_and_table(results):
    run = results / "2026-11-30_nvidia-h200_9b" / "records.jsonl"
    written = plot.plot_run(run)
    assert [p.name for p in written] == ["speedup.png", "prefill.png", "decode.png", "table.md"]
    assert all(_is_png(p) for p in written[:3])
    assert (run.parent / "table.md").read_text() == plot.markdown_table(read_records(run))
    # without our engine's records there is nothing to divide: no speedup plot
    names = [p.name for p in plot.plot_run(results / "2026-11-29_nvidia-h200_27b" / "records.jsonl")]
    assert names == ["prefill.png", "decode.png", "table.md"]


def test_main_regenerates_readme(results, capsys):
    assert plot.main([str(results)]) == 0
    readme = (results / "README.md").read_text()
    assert "never edit it by hand" in readme
    # newest run first, each with its table and links to its plots
    assert readme.index("## 2026-11-30_nvidia-h200_9b") < readme.index("## 2026-11-29_nvidia-h200_27b")
    assert "[speedup.png](2026-11-30_nvidia-h200_9b/speedup.png)" in readme
    assert "| 27b | pp8192 | 2,866.2 (ub 512) |  |  |  |  |" in readme
    assert str(results / "README.md") in capsys.readouterr().out


def test_readme_root(results, tmp_path):
    run = results / "2026-11-30_nvidia-h200_9b"
    assert plot._readme_root(run) == results.resolve()
    assert plot._readme_root(run / "records.jsonl") == results.resolve()
    elsewhere = tmp_path / "runs"
    write_records(elsewhere / "one" / "records.jsonl", read_records(run / "records.jsonl"))
    assert plot._readme_root(elsewhere) == elsewhere.resolve()
    assert plot._readme_root(elsewhere / "one") is None


def test_main_single_run_without_readme(results):
    assert plot.main([str(results / "2026-11-30_nvidia-h200_9b"), "--no-readme"]) == 0
    assert not (results / "README.md").exists()
    assert _is_png(results / "2026-11-30_nvidia-h200_9b" / "speedup.png")


def test_main_reports_missing_input(tmp_path, capsys):
    assert plot.main([str(tmp_path / "nothing")]) == 1
    assert "error:" in capsys.readouterr().err
    empty = tmp_path / "results"
    empty.mkdir()
    assert plot.main([str(empty)]) == 0     # a fresh checkout: nothing to plot, the README says so
    assert "no records.jsonl" in capsys.readouterr().err and "No runs yet" in (empty / "README.md").read_text()


def test_empty_results_readme(tmp_path):
    text = plot.write_results_readme(tmp_path).read_text()
    assert "No runs yet" in text


def test_compile_cell_says_cold_or_warm():
    assert plot._compile_cell(None) == ""
    assert plot._compile_cell({"compile_seconds": 17.49}) == "17.5"
    warm = {"compile_seconds": 0.74, "settings": {"kernel_start": "warm"}}
    assert plot._compile_cell(warm) == "0.7 (warm)"
