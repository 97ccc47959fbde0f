"""Machine description: GPU fields from nvidia-smi, versions, git commit and dirty flag."""
from __future__ import annotations

import stat
import subprocess

import pytest

from benchmarks import machine

FAKE_SMI = """#!/bin/sh
if [ "$1" = "--query-gpu=name,driver_version,compute_cap,memory.total" ]; then
  echo "NVIDIA H200, 580.95.05, 9.0, 143771"
  echo "NVIDIA H200, 580.95.05, 9.0, 143771"
else
  echo "| NVIDIA-SMI 580.95.05     Driver Version: 580.95.05      CUDA Version: 13.0     |"
fi
"""


@pytest.fixture
def fresh_gpu_info():
    machine.gpu_info.cache_clear()
    yield
    machine.gpu_info.cache_clear()


def test_gpu_info_from_nvidia_smi(tmp_path, monkeypatch, fresh_gpu_info):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine.gpu_info() == {"gpu": "NVIDIA H200", "gpu_count": 2, "driver": "580.95.05", "cuda": "13.0",
                                  "compute_cap": "9.0", "gpu_memory_mib": 143771}


def test_gpu_info_without_nvidia_smi(tmp_path, monkeypatch, fresh_gpu_info):
    monkeypatch.setenv("PATH", str(tmp_path))
    info = machine.gpu_info()
    assert info["gpu"] is None and info["gpu_count"] == 0 and info["driver"] is None


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_git_state(tmp_path):
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("git is not installed")
    assert machine.git_state(tmp_path) == {"git_commit": None, "git_dirty": None}
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("1")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "one")
    state = machine.git_state(tmp_path)
    assert len(state["git_commit"]) == 40 and state["git_dirty"] is False
    (tmp_path / "untracked.jsonl").write_text("results are untracked")
    assert machine.git_state(tmp_path)["git_dirty"] is False
    (tmp_path / "a.txt").write_text("2")
    assert machine.git_state(tmp_path)["git_dirty"] is True


def test_machine_info_fields():
    info = machine.machine_info()
    for key in ("gpu", "driver", "cuda", "cpu", "numba", "numba_cuda", "numpy", "python", "git_commit",
                "git_dirty"):
        assert key in info
    assert info["numba_cuda"] == "0.30.4" and info["cpu"]
