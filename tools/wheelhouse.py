"""Build a wheelhouse for installing ninfer_numba on a machine without internet.

``python -m tools.wheelhouse --python 3.12 --arch x86_64 --out wheelhouse`` downloads binary
wheels of every dependency in pyproject.toml (and the dev and bench extras) for that interpreter and platform,
dependencies included. On the offline machine: ``make test PYTHON=python3 OFFLINE=1`` (or any target)
installs from it whatever that interpreter lacks and keeps what it has.

``--skip pkg,pkg`` leaves out packages the target already has (e.g. a CUDA image's numba-cuda and
numpy, whose wheels with the CUDA toolkit run to hundreds of MB): their own dependencies are still
resolved from what is downloaded.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

MANYLINUX = ["manylinux_2_39", "manylinux_2_35", "manylinux_2_34", "manylinux_2_31", "manylinux_2_28",
             "manylinux_2_27", "manylinux_2_24", "manylinux_2_17", "manylinux2014", "manylinux1"]


def requirements(pyproject: Path, extras: tuple[str, ...] = ("dev",)) -> list[str]:
    meta = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(meta["dependencies"])
    for e in extras:
        reqs += meta.get("optional-dependencies", {}).get(e, [])
    return reqs


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~\[;]", req, maxsplit=1)[0].lower().replace("_", "-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default="3.12", help="target Python version, e.g. 3.12")
    ap.add_argument("--arch", default="x86_64", help="x86_64 or aarch64")
    ap.add_argument("--out", default="wheelhouse")
    ap.add_argument("--skip", default="", help="comma-separated packages the target already has")
    ap.add_argument("--extras", default="dev,bench")
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    skip = {s.strip().lower().replace("_", "-") for s in a.skip.split(",") if s.strip()}
    reqs = [r for r in requirements(root / "pyproject.toml", tuple(filter(None, a.extras.split(","))))
            if _name(r) not in skip]
    plats = [f"--platform={p}_{a.arch}" for p in MANYLINUX]
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", f"--python-version={a.python}",
           "--implementation=cp", *plats, "-d", a.out, *reqs]
    print(f"downloading {len(reqs)} requirements (+ dependencies) for Python {a.python} {a.arch} into {a.out}/",
          file=sys.stderr)
    rc = subprocess.call(cmd)
    if rc == 0:
        wheels = sorted(Path(a.out).glob("*.whl"))
        size = sum(w.stat().st_size for w in wheels)
        print(f"{len(wheels)} wheels, {size / 1e6:.1f} MB in {a.out}/", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
