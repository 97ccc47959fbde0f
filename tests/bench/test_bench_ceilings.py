"""Per-token work of a model file, roofline fractions, kernel throughput and the microbenchmark clock."""
from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.ceilings import (KV_BYTES_PER_VALUE, ModelCost, kernel_throughput, null_ceilings, roofline)
from benchmarks.kernels.conftest import ReplayClock, copies_to_defeat_l2, rotated
from benchmarks.records import BenchTest

CEILINGS = {"copy_gbps": 4000.0, "int8_tops": 800.0, "method": "test", "note": ""}


def _expected_cost(shape: str, tied: bool) -> tuple[int, int, int]:
    """(total tensor bytes, embedding bytes, Q8_0 matrix params without token_embd/output), enumerated
    from the synthetic writer's own tensor plan, independently of the GGUF reader."""
    from ninfer_numba.synth import SHAPES, tensor_plan
    total = embd = gemm = 0
    for name, shp, kind, _ in tensor_plan(SHAPES[shape], tied):
        n = int(np.prod(shp))
        nbytes = n // 32 * 34 if kind == "q8" else n * 4
        total += nbytes
        if name == "token_embd.weight":
            embd = nbytes
        elif kind == "q8" and name != "output.weight":
            gemm += n
    return total, embd, gemm


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_model_cost_of_tiny(tmp_path, tied):
    synth = pytest.importorskip("ninfer_numba.synth")
    path = synth.write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", seed=0, vocab=False, tied=tied)
    cost = ModelCost.from_gguf(path)
    total, embd, gemm = _expected_cost("tiny", tied)
    assert cost.model_size_bytes == total and cost.gemm_params == gemm
    s = synth.SHAPES["tiny"]
    # tied: the table is read again for the logits; untied: one row (n_embd/32 blocks of 34 bytes) per token
    assert cost.weight_bytes_per_token == (total if tied else total - embd + s.n_embd // 32 * 34)
    n_attn = s.n_layer // 4
    assert cost.kv_values_per_token == n_attn * 2 * s.n_head_kv * s.head_dim


def test_decode_roofline_counts_weights_and_mean_kv():
    cost = ModelCost(model_size_bytes=10**10, weight_bytes_per_token=8 * 10**9, gemm_params=7 * 10**9,
                     kv_values_per_token=8 * 2 * 4 * 256)
    test = BenchTest(0, 128, 32768)
    per_token = 8e9 + 16384 * 2.0 * (32768 + 64.5)         # token i of 128 sees 32768 + i positions
    assert cost.decode_bytes_per_token(test, "f16") == pytest.approx(per_token)
    roof = roofline(test, 200.0, cost, CEILINGS, "f16")
    assert roof["metric"] == "GB/s" and roof["achieved"] == pytest.approx(per_token * 200 / 1e9)
    assert roof["fraction"] == pytest.approx(roof["achieved"] / 4000.0)
    q8 = roofline(test, 200.0, cost, CEILINGS, "q8_0")["achieved"]
    assert q8 < roof["achieved"] and KV_BYTES_PER_VALUE["q8_0"] == 34 / 32
    unknown = roofline(test, 200.0, cost, CEILINGS, "tq3")
    assert unknown["achieved"] is None and unknown["fraction"] is None


def test_prefill_roofline_is_int8_ops():
    cost = ModelCost(10**10, 8 * 10**9, 6_920_000_000, 0)
    roof = roofline(BenchTest(2048, 0), 8785.0, cost, CEILINGS, "f16")
    # anchors.md §4: llama.cpp's 9B pp2048 runs at ~122 effective int8 TOPS
    assert roof["metric"] == "int8 TOPS" and roof["achieved"] == pytest.approx(2 * 6.92e9 * 8785 / 1e12)
    assert 121 < roof["achieved"] < 122.5 and roof["fraction"] == pytest.approx(roof["achieved"] / 800)
    assert roofline(BenchTest(2048, 0), 8785.0, cost, null_ceilings("cpu"), "f16")["fraction"] is None


def test_kernel_throughput():
    r = kernel_throughput(2e-6, CEILINGS, bytes_moved=6e6, int8_ops=1.6e9)
    assert r["gbps"] == pytest.approx(3000.0) and r["copy_fraction"] == pytest.approx(0.75)
    assert r["tops"] == pytest.approx(800.0) and r["int8_fraction"] == pytest.approx(1.0)
    r = kernel_throughput(1e-3, null_ceilings("none"), bytes_moved=1e9)
    assert r["gbps"] == pytest.approx(1000.0) and r["copy_fraction"] is None and r["tops"] is None
    with pytest.raises(ValueError):
        kernel_throughput(0.0, CEILINGS, bytes_moved=1.0)


def test_rotated_cycles_buffer_sets():
    seen = []
    launch = rotated(lambda stream, a, b: seen.append((stream, a, b)), [(1, 2), (3, 4), (5, 6)])
    for _ in range(7):
        launch("s")
    assert [x[1] for x in seen] == [1, 3, 5, 1, 3, 5, 1] and {x[0] for x in seen} == {"s"}
    with pytest.raises(ValueError):
        rotated(lambda s: None, [])


def test_copies_to_defeat_l2():
    l2 = 60 * 2**20
    assert copies_to_defeat_l2(10 * l2, l2) == 2                 # already far beyond L2: two sets suffice
    assert copies_to_defeat_l2(l2 // 2, l2) == 9
    assert copies_to_defeat_l2(0, l2) == math.ceil(4 * l2) + 1


def test_replay_clock_drives_pytest_benchmark(benchmark):
    """The clock trick that reports CUDA-event times through pytest-benchmark, on the installed version."""
    samples = [3e-6, 1e-6, 2e-6, 5e-6]
    clock = ReplayClock(samples)
    assert hasattr(benchmark, "_timer")
    benchmark._timer = clock
    benchmark.pedantic(clock.advance, rounds=len(samples), iterations=1, warmup_rounds=0)
    if benchmark.stats is None:
        pytest.skip("pytest-benchmark is disabled (--benchmark-disable)")
    stats = benchmark.stats.stats
    assert stats.min == pytest.approx(1e-6) and stats.max == pytest.approx(5e-6)
    assert stats.median == pytest.approx(2.5e-6) and stats.rounds == 4
