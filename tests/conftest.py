"""Shared fixtures: tiny synthetic GGUF models written once per session, and GPU/simulator markers."""
from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    """gpu tests skip without a real GPU; cudasim tests skip unless the simulator or a GPU is there."""
    from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
    has_gpu = gpu_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run make test-gpu on a GPU machine)")
    skip_sim = pytest.mark.skip(reason="kernel test: needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        elif "cudasim" in item.keywords and not (SIMULATOR or has_gpu):
            item.add_marker(skip_sim)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_dir) -> str:
    """Tiny synthetic qwen35 with the real Qwen3.5 vocabulary and chat template (tied embeddings)."""
    from ninfer_numba.synth import write_synthetic_gguf
    return str(write_synthetic_gguf(model_dir / "tiny.gguf", "tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_novocab(model_dir) -> str:
    from ninfer_numba.synth import write_synthetic_gguf
    return str(write_synthetic_gguf(model_dir / "tiny-novocab.gguf", "tiny", seed=1, vocab=False))


@pytest.fixture(scope="session")
def tiny_untied(model_dir) -> str:
    from ninfer_numba.synth import write_synthetic_gguf
    return str(write_synthetic_gguf(model_dir / "tiny-untied.gguf", "tiny", seed=2, vocab=False, tied=False))


@pytest.fixture
def rng():
    return __import__("numpy").random.default_rng(int(os.environ.get("NINFER_TEST_SEED", "0")))
