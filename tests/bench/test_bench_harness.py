"""The harness: llama-bench command lines, model files, and end-to-end runs on the tiny model (CPU backend)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from benchmarks import harness, llamacpp
from benchmarks.records import parse_tests, read_records
from tests.bench.conftest import FIXTURES

try:
    from ninfer_numba import LLM  # noqa: F401
    from ninfer_numba.synth import write_synthetic_gguf
    ENGINE_MISSING = None
except ImportError as e:  # the engine API is developed alongside; the end-to-end tests wait for it
    ENGINE_MISSING = f"ninfer_numba.LLM / synth not importable yet: {e}"

needs_engine = pytest.mark.skipif(ENGINE_MISSING is not None, reason=str(ENGINE_MISSING))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    harness.add_arguments(parser)
    return parser.parse_args(argv)


def test_llamacpp_commands_match_the_protocol():
    cmds = harness.llamacpp_commands(Path("/x/llama-bench"), Path("m.gguf"), parse_tests(harness.GPU_TESTS), 3, "f16")
    assert len(cmds) == 2
    common = ["/x/llama-bench", "-m", "m.gguf", "-fa", "1", "-ngl", "99", "-r", "3", "-o", "jsonl", "--progress",
              "-ctk", "f16", "-ctv", "f16"]
    assert cmds[0] == common + ["-p", "512,2048,8192,32768", "-n", "0", "-d", "0", "-ub", "512,1024,2048"]
    assert cmds[1] == common + ["-p", "0", "-n", "128", "-d", "0,8192,32768"]


def test_llamacpp_commands_group_and_map_kv_types():
    assert harness.llamacpp_kv_type("f16", None) == "f16"
    lc_kv = harness.llamacpp_kv_type("k4v4", "q8_0")
    cmds = harness.llamacpp_commands(Path("b"), Path("m"), parse_tests("tg16,pp128,tg32@d64,tg16@d64"), 1, lc_kv)
    assert [c[c.index("-p"):c.index("-p") + 6] for c in cmds] == [
        ["-p", "128", "-n", "0", "-d", "0"], ["-p", "0", "-n", "16", "-d", "0,64"], ["-p", "0", "-n", "32", "-d", "64"]]
    assert cmds[0][cmds[0].index("-ctk") + 1] == "q8_0"
    assert harness.llamacpp_kv_type("k3v3", None) == "f16"        # llama.cpp has no such cache
    assert harness.llamacpp_kv_type("k3v3", "q4_0") == "q4_0"     # asked for explicitly


def test_llamacpp_commands_select_the_split_mode():
    devices = llamacpp.llama_devices([0, 1])
    cmds = harness.llamacpp_commands(Path("b"), Path("m"), parse_tests("pp64,tg8"), 2, "f16", devices)
    for cmd in cmds:
        assert cmd.count("-sm") == 1 and cmd[cmd.index("-sm"):cmd.index("-sm") + 3] == ["-sm", "layer", "-ctk"]
    assert "-sm" not in harness.llamacpp_commands(Path("b"), Path("m"), parse_tests("tg8"), 2, "f16")[0]


@pytest.mark.parametrize("gpus, visible, split", [("", "0", "none"), ("2", "0,1", "layer"), ("1,", "1", "none"),
                                                  ("0,0", "0", "none"), ("1,0,1", "1,0", "layer")])
def test_llamacpp_devices_follow_our_gpus(monkeypatch, gpus, visible, split):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sel = harness.llamacpp_devices(gpus, "cuda")
    assert (sel.visible, sel.split_mode) == (visible, split)      # unset: the plain runner's GPU 0 alone
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert harness.llamacpp_devices("2", "cuda").visible == "5,7"


def test_llamacpp_devices_on_the_cpu_and_bad_lists():
    assert harness.llamacpp_devices("", "cpu") is None
    with pytest.raises(ValueError, match="cuda backend"):
        harness.llamacpp_devices("0", "cpu")
    with pytest.raises(ValueError, match="a count or a comma-separated list"):
        harness.llamacpp_devices("zero", "cuda")


def test_roofline_bytes_of_the_coded_caches():
    from benchmarks.ceilings import KV_BYTES_PER_VALUE
    assert KV_BYTES_PER_VALUE["k3v3"] == (96 + 2) / 256            # 3 bits per value plus a float16 norm
    assert KV_BYTES_PER_VALUE["k4v3"] == (128 + 2 + 96 + 2) / 512
    assert KV_BYTES_PER_VALUE["k4v4"] < KV_BYTES_PER_VALUE["q4_0"] < KV_BYTES_PER_VALUE["q8_0"]  # 4.06 < 4.5 < 8.5 bits


def test_model_path(tmp_path):
    assert harness.model_path("9b", tmp_path) == ("9b", tmp_path / "q35-9b.gguf")
    assert harness.model_path("/data/Qwen3.5-9B-Q8_0.gguf", tmp_path) == ("Qwen3.5-9B-Q8_0",
                                                                          Path("/data/Qwen3.5-9B-Q8_0.gguf"))
    with pytest.raises(ValueError, match="unknown model '13b'"):
        harness.model_path("13b", tmp_path)
    with pytest.raises(FileNotFoundError):
        harness.ensure_model(str(tmp_path / "missing.gguf"), tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--tests", "pp512@d64"], "depth fill"), (["--reps", "0"], "--reps"), (["--tests", "pp12x"], "bad test"),
    (["--models", "13b"], "unknown model"), (["--models", "/nonexistent/m.gguf"], "does not exist"),
    (["--gpus", "0,1"], "needs the cuda backend")])
def test_bad_options_exit_2(tmp_path, capsys, argv, message):
    args = parse(["--backend", "cpu", "--skip-llamacpp", "--out", str(tmp_path / "out"),
                  "--model-dir", str(tmp_path), *argv])
    assert harness.run(args) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A model folder holding the tiny synthetic model under the harness's file name."""
    if ENGINE_MISSING:
        pytest.skip(ENGINE_MISSING)
    folder = tmp_path_factory.mktemp("models")
    write_synthetic_gguf(folder / "q35-tiny.gguf", "tiny", seed=0, vocab=False)
    return folder


@needs_engine
def test_cpu_run_end_to_end(tiny_dir, tmp_path, capsys):
    readme = harness.RESULTS_DIR / "README.md"
    readme_before = readme.read_text() if readme.exists() else None
    out = tmp_path / "run"
    args = parse(["--backend", "cpu", "--skip-llamacpp", "--tests", "pp128,tg16", "--reps", "2",
                  "--model-dir", str(tiny_dir), "--out", str(out)])
    assert harness.run(args) == 0
    recs = read_records(out / "records.jsonl")
    assert [(r["engine"], r["test"]) for r in recs] == [("ninfer", "pp128"), ("ninfer", "tg16")]
    for r in recs:
        assert r["model"] == "tiny" and r["backend"] == "cpu" and r["gpu"].startswith("CPU ")
        assert len(r["samples_tps"]) == 2 and r["min_tps"] <= r["median_tps"] <= r["max_tps"] and r["min_tps"] > 0
        assert r["compile_seconds"] == 0.0 and r["settings"]["backend"] == "cpu"
        assert r["settings"]["max_seq"] >= 128 and r["ceilings"]["copy_gbps"] is None
        assert r["roofline"]["achieved"] > 0 and r["roofline"]["fraction"] is None
        assert r["git_commit"] and r["numba_cuda"] == "0.30.4"
    assert sorted(p.name for p in out.iterdir()) == ["decode.png", "model_cost.json", "prefill.png",
                                                    "records.jsonl", "table.md"]
    captured = capsys.readouterr()
    assert "| tiny | pp128 |" in captured.out and "CPU run" in captured.err and "ninfer tg16 rep 2/2" in captured.err
    assert (readme.read_text() if readme.exists() else None) == readme_before  # results/ is never touched


@needs_engine
def test_cpu_run_says_when_llamacpp_is_missing(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.delenv("LLAMACPP_SRC", raising=False)
    monkeypatch.setattr(llamacpp, "DEFAULT_CACHE", tmp_path / "no-cache")
    args = parse(["--backend", "cpu", "--tests", "pp16", "--reps", "1", "--model-dir", str(tiny_dir),
                  "--out", str(tmp_path / "run")])
    assert harness.run(args) == 0
    assert "llama.cpp skipped: no CPU build of llama-bench" in capsys.readouterr().err
    assert [r["engine"] for r in read_records(tmp_path / "run" / "records.jsonl")] == ["ninfer"]


FAKE_LLAMA_BENCH = '''#!{python}
"""Stands in for llama-bench: one JSONL row per requested (prompt, gen, depth, ubatch), like the real one;
its split_mode and devices fields say which -sm it was given and which CUDA_VISIBLE_DEVICES it saw."""
import itertools, json, os, sys
a = sys.argv[1:]
opt = lambda flag, default: [int(x) for x in (a[a.index(flag) + 1] if flag in a else default).split(",")]
template = json.loads(open({template!r}).readline())
for p, n, d, ub in itertools.product(opt("-p", "512"), opt("-n", "128"), opt("-d", "0"), opt("-ub", "512")):
    reps = opt("-r", "5")[0]
    base = 1000.0 + ub / 8 if n == 0 else 50.0 - d / 64   # ub 2048 wins prefill; depth slows decode
    row = dict(template, model_filename=a[a.index("-m") + 1], n_prompt=p, n_gen=n, n_depth=d, n_ubatch=ub,
               type_k=a[a.index("-ctk") + 1], type_v=a[a.index("-ctv") + 1], build_number=8475,
               build_commit="49bfdde", samples_ts=[base + i for i in range(reps)],
               split_mode=a[a.index("-sm") + 1] if "-sm" in a else "layer",
               devices=os.environ.get("CUDA_VISIBLE_DEVICES", "auto"))
    print(json.dumps(row))
'''


@needs_engine
def test_run_with_llamacpp_baseline(tiny_dir, tmp_path, capsys):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, template=str(FIXTURES / "pp_9b.jsonl")))
    fake.chmod(0o755)
    out = tmp_path / "run"
    args = parse(["--backend", "cpu", "--tests", "pp32,pp64,tg4@d8", "--reps", "2", "--model-dir", str(tiny_dir),
                  "--out", str(out), "--llama-bench", str(fake)])
    assert harness.run(args) == 0
    recs = read_records(out / "records.jsonl")
    assert [(r["engine"], r["test"]) for r in recs] == [
        ("llama.cpp", "pp32"), ("llama.cpp", "pp64"), ("llama.cpp", "tg4 @ d8"),
        ("ninfer", "pp32"), ("ninfer", "pp64"), ("ninfer", "tg4 @ d8")]
    lc = {r["test"]: r for r in recs if r["engine"] == "llama.cpp"}
    assert lc["pp32"]["settings"]["n_ubatch"] == 2048 and lc["pp32"]["median_tps"] == 1256.5
    assert lc["pp32"]["settings"]["ubatch_tps"] == {"512": 1064.5, "1024": 1128.5, "2048": 1256.5}
    assert lc["tg4 @ d8"]["median_tps"] == 50.0 - 8 / 64 + 0.5
    assert all(r["llamacpp_build"] == "b8475 (b8462 + 13, 49bfdde)" for r in recs)
    raw = [json.loads(line) for line in (out / "llamacpp_raw.jsonl").read_text().splitlines()]
    assert len(raw) == 2 * 3 + 1      # every micro-batch row is kept raw, only the best becomes a record
    assert (out / "speedup.png").is_file()
    assert "| tiny | pp32 | 1,256.5 (ub 2048) |" in capsys.readouterr().out


def _real_cpu_llama_bench() -> Path | None:
    try:
        return llamacpp.find_llama_bench(None, llamacpp.DEFAULT_CACHE, cuda_arch=None)
    except FileNotFoundError:
        return None


@needs_engine
@pytest.mark.slow
@pytest.mark.skipif(_real_cpu_llama_bench() is None, reason="no CPU build of llama-bench in .cache/llama.cpp")
def test_real_llama_bench_cpu_build_on_tiny(tiny_dir, tmp_path):
    out = tmp_path / "run"
    args = parse(["--backend", "cpu", "--tests", "pp64,tg4", "--reps", "1", "--model-dir", str(tiny_dir),
                  "--out", str(out)])
    assert harness.run(args) == 0
    lc = [r for r in read_records(out / "records.jsonl") if r["engine"] == "llama.cpp"]
    assert [r["test"] for r in lc] == ["pp64", "tg4"]
    assert all(r["llamacpp_build"] == "b8475 (b8462 + 13, 49bfdde)" and r["median_tps"] > 0 for r in lc)


def _fake_llama_bench(tmp_path: Path) -> Path:
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, template=str(FIXTURES / "pp_9b.jsonl")))
    fake.chmod(0o755)
    return fake


def test_run_llamacpp_passes_devices_to_llama_bench(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    rows = harness.run_llamacpp(_fake_llama_bench(tmp_path), Path("m.gguf"), parse_tests("pp32,tg4"), 1, "f16",
                                tmp_path / "raw.jsonl", llamacpp.llama_devices([2, 0], "3,5,6"))
    assert [(r["split_mode"], r["devices"]) for r in rows] == [("layer", "6,3")] * 2   # what the child saw
    rows = harness.run_llamacpp(_fake_llama_bench(tmp_path), Path("m.gguf"), parse_tests("tg4"), 1, "f16",
                                tmp_path / "raw.jsonl")
    assert [(r["split_mode"], r["devices"]) for r in rows] == [("layer", "3,5,6")]    # no selection: inherited


@needs_engine
def test_split_run_records_say_which_gpus(tiny_dir, tmp_path, monkeypatch):
    """A --gpus 0,0 run as on a GPU (our engine replaced): both engines' records carry the setting, the
    device label says it, llama.cpp's settings say it ran unsplit on GPU 0."""
    from benchmarks.ceilings import null_ceilings

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = {}

    def fake_ninfer(model, tests, reps, backend, kv_type, gemm, prefill_graphs, pdl, gpus, kvq_partial):
        seen["gpus"], seen["kvq_partial"] = gpus, kvq_partial
        described = {"backend": backend, "shards": ["GPU 0: layers 0-1", "GPU 0: layers 2-3"]}
        return [(t, [10.0, 12.0], dict(described), 1.5) for t in tests], described
    monkeypatch.setattr(harness, "run_ninfer", fake_ninfer)
    args = parse(["--models", "tiny", "--tests", "pp32,tg4", "--reps", "2", "--model-dir", str(tiny_dir),
                  "--out", str(tmp_path / "run"), "--gpus", "0,0"])
    devices = harness.llamacpp_devices(args.gpus, "cuda")
    out = harness.bench_model("tiny", args, parse_tests(args.tests), "cuda", {"gpu": "NVIDIA H200", "cpu": "x"},
                              null_ceilings("test"), _fake_llama_bench(tmp_path), devices)
    recs = read_records(out)
    assert seen["gpus"] == "0,0" and seen["kvq_partial"] == "auto"
    assert [(r["engine"], r["gpus"], r["gpu"]) for r in recs] == [
        (e, "0,0", "NVIDIA H200 (gpus 0,0)") for e in ("llama.cpp", "llama.cpp", "ninfer", "ninfer")]
    for r in recs[:2]:
        assert r["settings"]["split_mode"] == "none"
        assert r["settings"]["device_selection"] == {
            "cuda_visible_devices": "0", "split_mode": "none", "n_devices": 1,
            "note": "shards sharing a device apply to ninfer only (2 shards); llama.cpp runs unsplit on it"}
    assert recs[2]["settings"]["shards"] == ["GPU 0: layers 0-1", "GPU 0: layers 2-3"]
    folder = harness.output_folder(parse(["--gpus", "0,1"]), "NVIDIA H200 (gpus 0,1)", "9b", 1)
    assert folder.name.split("_", 1)[1].startswith("nvidia-h200-gpus-0-1_9b")     # split runs get their own folder
