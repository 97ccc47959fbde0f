"""llama.cpp as a logits oracle (benchmarks/llamacpp_logits.py), where a llama.cpp build exists locally.

The tiny synthetic model has four layers, too few for int8 rounding flips to cascade far: llama.cpp's logits
(8-bit activations, its own blocking) stay within a few percent of our float reference there.
"""
import numpy as np
import pytest

from benchmarks.llamacpp import DEFAULT_CACHE, find_llama_bench


def test_llamacpp_logits_match_the_reference_on_the_tiny_model(tiny_novocab):
    bench = find_llama_bench(None, DEFAULT_CACHE)
    if bench is None:
        pytest.skip("llama.cpp is not built here (python -m benchmarks.llamacpp build)")
    from benchmarks.llamacpp_logits import build_tool, llamacpp_logits
    from ninfer_numba import LLM
    tool = build_tool(bench, DEFAULT_CACHE / "src")
    llm = LLM(tiny_novocab, backend="cpu", max_seq=32)
    ids = np.random.default_rng(0).integers(0, llm.config.n_vocab, 16).tolist()
    theirs = llamacpp_logits(tool, tiny_novocab, ids)
    ours = llm.logits(ids)
    assert theirs.shape == ours.shape == (16, llm.config.n_vocab)
    rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
    assert rel < 0.1 and np.mean(ours.argmax(1) == theirs.argmax(1)) >= 0.9, rel
