"""Every notebook under notebooks/ runs top to bottom on the CPU (nbclient, a fresh kernel each), in a scratch
folder holding a copy of results/ so that plots a notebook writes never touch the checkout."""
import shutil
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="the notebook extra is not installed (pip install -e .[notebook])")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("notebooks")
    shutil.copytree(ROOT / "results", work / "results")
    return work


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, workdir):
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    errors = [out for cell in book.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
              if out.get("output_type") == "error"]
    assert not errors
