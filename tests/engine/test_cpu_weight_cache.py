"""The cpu backend's weight cache (EngineConfig.cpu_weight_cache_mb -> model/weights.DequantCache): the same
tokens and logits as dequantizing on every use, the matrices kept within the budget, and the flag."""
import numpy as np
import pytest

from ninfer_numba import LLM, SamplingParams
from ninfer_numba.cli import _engine_kwargs, build_parser

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def test_cached_weights_give_the_same_tokens_and_logits(tiny_model):
    ids = list(range(100, 140))
    plain = LLM(tiny_model, backend="cpu", max_seq=128, cpu_weight_cache_mb=0)
    cached = LLM(tiny_model, backend="cpu", max_seq=128, cpu_weight_cache_mb=64)
    assert plain.runner.model.cache is None
    for _ in range(2):                          # the second call takes the matrices in, the third hits them
        assert cached.generate(ids, GREEDY).token_ids == plain.generate(ids, GREEDY).token_ids
    cache = cached.runner.model.cache
    assert cache.entries and 0 < cache.used_bytes <= 64 << 20
    np.testing.assert_array_equal(cached.logits(ids), plain.logits(ids))


def test_the_flag_and_its_bounds():
    a = build_parser().parse_args(["serve", "--model", "m.gguf", "--cpu-weight-cache-mb", "0"])
    assert _engine_kwargs(a)["cpu_weight_cache_mb"] == 0
    assert _engine_kwargs(build_parser().parse_args(["serve", "--model", "m.gguf"]))["cpu_weight_cache_mb"] == 1024
    from ninfer_numba.config import EngineConfig
    with pytest.raises(ValueError, match="cpu_weight_cache_mb"):
        EngineConfig(cpu_weight_cache_mb=-1)
