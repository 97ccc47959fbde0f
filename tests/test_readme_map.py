"""The README's code map ("What runs where") against the tree: every path it names exists, and every package of
ninfer_numba (each kernel family included) is named, so the map cannot drift from `git ls-files` unnoticed."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ninfer_numba"


def _map_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## What runs where", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| piece")]


def _named_paths() -> list[str]:
    """The backticked tokens of the map's 'where' column that look like paths."""
    names = []
    for row in _map_rows():
        where = row.rstrip(" |").rsplit(" | ", 1)[-1]
        names += [t for t in re.findall(r"`([^`]+)`", where) if " " not in t and ("/" in t or t.endswith(".py"))]
    return names


def _exists(name: str) -> bool:
    for base in (ROOT, PKG):
        if any(ch in name for ch in "*?"):
            if list(base.glob(name)):
                return True
        elif (base / name).exists():
            return True
    return False


def test_every_path_in_the_map_exists():
    names = _named_paths()
    assert len(names) > 20, "the map's table was not found"
    missing = [n for n in names if not _exists(n)]
    assert not missing, f"README's code map names paths that are not in the tree: {missing}"


def test_every_package_is_in_the_map():
    named = {n.rstrip("/") for n in _named_paths()}
    packages = sorted(str(p.parent.relative_to(PKG)) for p in PKG.rglob("__init__.py") if p.parent != PKG)
    unnamed = [p for p in packages
               if not any(n == p or n.startswith(p + "/") or n == f"ninfer_numba/{p}"
                          or n.startswith(f"ninfer_numba/{p}/") for n in named)]
    assert not unnamed, f"packages missing from README's code map: {unnamed}"
