"""llama-bench JSONL parsing on the real H200 output, test names, and best-micro-batch selection."""
from __future__ import annotations

import json

import pytest

from benchmarks.records import (BenchTest, best_ubatch, llamacpp_build_label, median_tps, parse_test,
                                parse_tests, read_llama_bench_jsonl)
from benchmarks.records import test_name as llama_test_name
from tests.bench.conftest import FIXTURES


def test_real_fixtures_parse(llama_rows):
    assert sorted(llama_rows) == ["27b", "9b"]
    names = [llama_test_name(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in llama_rows["9b"]]
    assert names == ["pp512", "pp2048", "pp8192", "pp32768", "tg128", "tg128 @ d8192", "tg128 @ d32768"]
    row = llama_rows["9b"][0]
    assert row["build_number"] == 8462 and llamacpp_build_label(row) == "b8462 (29b28a9)"
    assert llamacpp_build_label(dict(row, build_number=8475, build_commit="49bfdde")) == "b8475 (b8462 + 13, 49bfdde)"
    assert row["samples_ts"] == [6898.19, 8885.26, 8845.55]
    # the median, not llama-bench's mean (8209.67), which the slow first repetition drags down
    assert median_tps(row) == 8845.55
    assert llama_rows["27b"][-1]["n_depth"] == 32768 and median_tps(llama_rows["27b"][-1]) == 57.9023


def test_parse_reads_paths_and_text_alike():
    path = FIXTURES / "tg_9b.jsonl"
    assert read_llama_bench_jsonl(path) == read_llama_bench_jsonl(path.read_text())


def test_parse_rejects_noise_and_missing_fields():
    good = (FIXTURES / "tg_9b.jsonl").read_text().splitlines()[0]
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_llama_bench_jsonl(good + "\nggml_cuda_init: found 1 CUDA devices\n")
    row = json.loads(good)
    del row["samples_ts"]
    with pytest.raises(ValueError, match="lacks.*samples_ts"):
        read_llama_bench_jsonl(json.dumps(row))


@pytest.mark.parametrize("spec, expected", [
    ("pp512", BenchTest(512, 0, 0)), ("tg128", BenchTest(0, 128, 0)),
    ("tg128@d8192", BenchTest(0, 128, 8192)), ("tg128 @ d32768", BenchTest(0, 128, 32768)),
    (" pp7 ", BenchTest(7, 0, 0))])
def test_parse_test(spec, expected):
    assert parse_test(spec) == expected
    assert parse_test(expected.name) == expected


@pytest.mark.parametrize("bad", ["pp", "tg0", "xx512", "pp512@8192", "tg128@d", "512"])
def test_parse_test_rejects(bad):
    with pytest.raises(ValueError, match="bad test"):
        parse_test(bad)


def test_parse_tests_dedups_in_order():
    assert [t.name for t in parse_tests("tg16,pp128,tg16 @ d0,pp128")] == ["tg16", "pp128"]
    with pytest.raises(ValueError):
        parse_tests(" , ")


def test_test_name_rejects_mixed():
    with pytest.raises(ValueError):
        llama_test_name(512, 128)
    with pytest.raises(ValueError):
        llama_test_name(0, 0)


def _with_ubatch(row: dict, n_ubatch: int, scale: float) -> dict:
    out = dict(row, n_ubatch=n_ubatch)
    out["samples_ts"] = [s * scale for s in row["samples_ts"]]
    return out


def test_best_ubatch_keeps_the_fastest_median(llama_rows):
    pp512, pp2048 = llama_rows["9b"][0], llama_rows["9b"][1]
    rows = [pp512, _with_ubatch(pp512, 1024, 1.05), _with_ubatch(pp512, 2048, 0.97),
            pp2048, _with_ubatch(pp2048, 1024, 0.9), _with_ubatch(pp2048, 2048, 0.99)]
    best = best_ubatch(rows)
    assert [(b["n_prompt"], b["n_ubatch"]) for b in best] == [(512, 1024), (2048, 512)]
    assert best[0]["ubatch_tps"] == {512: 8845.55, 1024: round(8845.55 * 1.05, 3), 2048: round(8845.55 * 0.97, 3)}
    assert median_tps(best[1]) == 8786.48


def test_best_ubatch_uses_median_not_mean(llama_rows):
    """A slow first repetition lowers the mean of ub 512 below ub 1024's, yet its median is higher."""
    pp512 = llama_rows["9b"][0]                      # mean 8209.7, median 8845.55
    flat = dict(pp512, n_ubatch=1024, samples_ts=[8500.0, 8500.0, 8500.0])
    assert best_ubatch([pp512, flat])[0]["n_ubatch"] == 512


def test_best_ubatch_separates_kv_types(llama_rows):
    tg = llama_rows["9b"][6]
    q8 = dict(tg, type_k="q8_0", type_v="q8_0", samples_ts=[158.4])
    best = best_ubatch([tg, q8])
    assert [(b["type_k"], median_tps(b)) for b in best] == [("f16", 161.322), ("q8_0", 158.4)]
