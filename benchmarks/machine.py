"""What a measurement ran on: GPU, driver, CUDA, library versions, CPU and the git state of the code.

Every benchmark record carries these fields so a number can be traced to hardware and source. Everything
here is read from ``nvidia-smi``, ``/proc/cpuinfo``, package metadata and ``git``; a missing tool gives None
for its fields, never an exception, because the CPU-only machines that run the tests have no nvidia-smi.
"""
from __future__ import annotations

import os

import platform
import re
import shutil
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a command, or None when the tool is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


@lru_cache(maxsize=1)
def gpu_info() -> dict:
    """First GPU's name, driver, compute capability, memory and the driver's CUDA version (None without one)."""
    info = {"gpu": None, "gpu_count": 0, "driver": None, "cuda": None, "compute_cap": None, "gpu_memory_mib": None}
    rows = _run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                 "--format=csv,noheader,nounits"])
    if not rows or not rows.strip():
        return info
    lines = [line for line in rows.splitlines() if line.strip()]
    name, driver, cap, mem = (field.strip() for field in lines[0].split(","))
    info.update(gpu=name, gpu_count=len(lines), driver=driver, compute_cap=cap,
                gpu_memory_mib=int(mem) if mem.isdigit() else None)
    header = _run(["nvidia-smi"]) or ""
    match = re.search(r"CUDA Version:\s*([0-9.]+)", header)
    info["cuda"] = match.group(1) if match else None
    return info


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions() -> dict:
    """Versions of the packages that decide kernel code and numerics (None when not installed)."""
    versions = {}
    for key, dist in (("numba", "numba"), ("numba_cuda", "numba-cuda"), ("numpy", "numpy"),
                      ("llvmlite", "llvmlite"), ("cuda_bindings", "cuda-bindings")):
        try:
            versions[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[key] = None
    versions["python"] = platform.python_version()
    return versions


def git_state(repo: Path = REPO_ROOT) -> dict:
    """Commit of HEAD and whether tracked files differ from it; untracked files and results/ (what benchmarks
    write, results/README.md included) do not count.

    NINFER_GIT_COMMIT, when set, names the commit and wins: a copy of the tree sent to a GPU machine may have
    no .git, or a stale one that does not describe the files; dirtiness is then unknown."""
    named = os.environ.get("NINFER_GIT_COMMIT")
    if named:
        return {"git_commit": named, "git_dirty": None}
    commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"], cwd=repo)
    return {"git_commit": commit.strip(), "git_dirty": None if status is None else bool(status.strip())}


def machine_info(repo: Path = REPO_ROOT) -> dict:
    """All of the above in one flat dict: gpu, gpu_count, driver, cuda, compute_cap, gpu_memory_mib, cpu,
    numba, numba_cuda, numpy, llvmlite, cuda_bindings, python, git_commit, git_dirty."""
    return {**gpu_info(), "cpu": cpu_name(), **package_versions(), **git_state(repo)}


if __name__ == "__main__":
    import json
    print(json.dumps(machine_info(), indent=1))
