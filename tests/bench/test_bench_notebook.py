"""notebooks/01_results.ipynb: valid nbformat 4 JSON, defines nothing, and its cells run on fixture records."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from benchmarks.records import read_records, write_records

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "01_results.ipynb"


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def _code_cells(nb: dict) -> list[str]:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_nbformat_structure(notebook):
    assert notebook["nbformat"] == 4 and isinstance(notebook["nbformat_minor"], int)
    assert notebook["metadata"]["kernelspec"]["language"] == "python"
    for cell in notebook["cells"]:
        assert cell["cell_type"] in ("markdown", "code") and isinstance(cell["source"], list)
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
    for i, src in enumerate(_code_cells(notebook)):
        compile(src, f"cell {i}", "exec")


def test_defines_nothing_reusable(notebook):
    code = "\n".join(_code_cells(notebook))
    assert "def " not in code and "class " not in code and "lambda" not in code
    assert "from benchmarks import plot" in code


def test_cells_run_on_fixture_records(notebook, tmp_path, monkeypatch, llama_records, ninfer_9b_file):
    write_records(tmp_path / "results" / "2026-11-30_nvidia-h200_9b" / "records.jsonl",
                  llama_records["9b"] + read_records(ninfer_9b_file))
    shown = []
    display_mod = types.ModuleType("IPython.display")   # Jupyter's display, recorded instead of rendered
    display_mod.display = shown.append
    display_mod.Markdown = lambda text: ("markdown", text)
    display_mod.Image = lambda filename: ("image", filename)
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: None                  # matplotlib asks whether it runs inside IPython
    ipython.version_info = (9, 0)
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display_mod)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, src in enumerate(_code_cells(notebook)):
        exec(compile(src, f"cell {i}", "exec"), namespace)
    markdown = [x[1] for x in shown if isinstance(x, tuple) and x[0] == "markdown"]
    images = [Path(x[1]).name for x in shown if isinstance(x, tuple) and x[0] == "image"]
    assert any("| 9b | pp512 | 8,845.5 (ub 512) | 9,350.0 | 1.06x |" in m for m in markdown)
    assert images == ["speedup.png", "prefill.png", "decode.png"]
    wide = next(x for x in shown if hasattr(x, "columns") and "speedup" in x.columns)
    assert wide.loc[("9b", "NVIDIA H200", "pp512"), "speedup"] == pytest.approx(9350.0 / 8845.55)
