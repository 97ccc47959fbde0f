"""CLI and Python API smoke tests on the tiny synthetic model (CPU backend)."""
import subprocess
import sys

import numpy as np
import pytest

from ninfer_numba import LLM, SamplingParams
from ninfer_numba.cli import main


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_numba", *args], capture_output=True, text=True,
                          timeout=300)


def test_make_model_and_generate(tmp_path):
    path = tmp_path / "m.gguf"
    r = _cli("make-model", "--shape", "tiny", "--out", str(path), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert path.exists() and "make-model tiny" in r.stderr
    r = _cli("generate", "--backend", "cpu", "--model", str(path), "--prompt", "Hello", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 0 and "8 tokens" in r.stderr


def test_logits_cli_matches_token_by_token(tiny_model, tmp_path):
    out = tmp_path / "l.npy"
    assert main(["logits", "--model", tiny_model, "--tokens", "5,17,200,9419,0", "--backend", "cpu",
                 "--out", str(out)]) == 0
    whole = np.load(out)
    assert whole.dtype == np.float32 and whole.shape == (5, 248320)
    llm = LLM(tiny_model, backend="cpu")
    llm.runner.reset()
    rows = [llm.runner.prefill([5])] + [llm.runner.decode(t) for t in (17, 200, 9419, 0)]
    inc = np.stack(rows)
    assert np.abs(whole - inc).max() <= 1e-4 * np.abs(whole).max()


def test_info(tiny_model, capsys):
    assert main(["info", "--model", tiny_model]) == 0
    out = capsys.readouterr().out
    assert "3 Gated DeltaNet, 1 attention" in out and "Q8_0" in out and "chat template yes" in out


def test_missing_model_is_a_clean_error(tmp_path, capsys):
    assert main(["info", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "error: model file not found" in capsys.readouterr().err


def test_bad_tokens_argument(tiny_model, tmp_path, capsys):
    assert main(["logits", "--model", tiny_model, "--tokens", "1,x", "--out", str(tmp_path / "o.npy"),
                 "--backend", "cpu"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_api_generate_greedy_is_deterministic(tiny_model):
    llm = LLM(tiny_model, backend="cpu")
    a = llm.generate("The capital of France is", SamplingParams(max_tokens=6))
    b = llm.generate(llm.encode("The capital of France is"), SamplingParams(max_tokens=6))
    assert a.token_ids == b.token_ids and a.completion_tokens == 6 and a.finish_reason == "length"
    assert a.text == llm.tokenizer.decode(a.token_ids)


def test_api_seeded_sampling_reproducible(tiny_model):
    llm = LLM(tiny_model, backend="cpu")
    p = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    assert llm.generate("Hi", p).token_ids == llm.generate("Hi", p).token_ids


def test_api_errors(tiny_model, tiny_novocab):
    llm = LLM(tiny_model, backend="cpu", max_seq=16)
    with pytest.raises(ValueError, match="exceeds the context"):
        llm.generate(list(range(10)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="out of range"):
        llm.logits([1, 248320])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    nv = LLM(tiny_novocab, backend="cpu")
    with pytest.raises(ValueError, match="no vocabulary"):
        nv.generate("hello")
    assert len(nv.generate([1, 2, 3], SamplingParams(max_tokens=3)).token_ids) == 3


def test_stop_token_ends_generation(tiny_model):
    llm = LLM(tiny_model, backend="cpu")
    first = llm.generate("Hello", SamplingParams(max_tokens=4)).token_ids
    r = llm.generate("Hello", SamplingParams(max_tokens=4, stop_token_ids=(first[1],)))
    assert r.token_ids == first[:2] and r.finish_reason == "stop"


def test_cuda_backend_without_a_gpu_says_so(tiny_novocab, capsys):
    from ninfer_numba.config import BackendUnavailableError
    from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
    if SIMULATOR or gpu_available():
        pytest.skip("a GPU (or the simulator) is present: the cuda backend can run")
    with pytest.raises(BackendUnavailableError, match="--backend cpu"):
        LLM(tiny_novocab, backend="cuda")
    assert main(["generate", "--model", tiny_novocab, "--prompt", "hi", "--backend", "cuda"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["logits", "--tokens", "1,,2", "--out", "{tmp}/x.npy"], "no empty entries"),
    (["logits", "--tokens", "1,2", "--out", "{tmp}"], "is a folder"),
    (["logits", "--tokens", "1,2", "--out", "{tmp}/x.npy", "--max-seq", "100000000"], "context length"),
    (["logits", "--tokens", "1,2", "--out", "{tmp}/x.npy", "--prefill-chunk", "0"], "prefill_chunk"),
], ids=["empty-token", "out-folder", "max-seq", "prefill-chunk"])
def test_cli_bad_arguments_are_one_line_errors(tiny_model, tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([argv[0], "--model", tiny_model, "--backend", "cpu", *argv[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_logits_out_is_the_exact_name_and_its_folder_is_made(tiny_model, tmp_path):
    out = tmp_path / "new" / "x.txt"
    assert main(["logits", "--model", tiny_model, "--backend", "cpu", "--tokens", "1,2", "--out", str(out)]) == 0
    assert out.exists() and not (tmp_path / "new" / "x.txt.npy").exists() and np.load(out).shape == (2, 248320)


def test_serve_port_is_checked():
    r = _cli("serve", "--model", "x.gguf", "--port", "99999")
    assert r.returncode == 2 and "port must be an integer in 1..65535" in r.stderr


def test_engine_flags_reach_the_engine_config(tiny_model, tmp_path, monkeypatch):
    """--gemm, --kv-type and --no-prefill-graphs set EngineConfig (CPU backend: recorded, not used)."""
    import ninfer_numba
    seen = {}
    real = ninfer_numba.LLM

    def spy(*args, **kw):
        llm = real(*args, **kw)
        seen["config"] = llm.engine_config
        return llm
    monkeypatch.setattr(ninfer_numba, "LLM", spy)
    out = tmp_path / "x.npy"
    assert main(["logits", "--model", tiny_model, "--backend", "cpu", "--tokens", "1,2", "--out", str(out),
                 "--gemm", "dp4a", "--kv-type", "f16", "--no-prefill-graphs", "--prefill-chunk", "64",
                 "--kvq-partial", "auto"]) == 0
    c = seen["config"]
    assert (c.gemm, c.kv_type, c.prefill_graphs, c.prefill_chunk, c.kvq_partial) == ("dp4a", "f16", False, 64,
                                                                                      "auto")
    r = _cli("logits", "--model", tiny_model, "--tokens", "1", "--out", str(out), "--kv-type", "q4")
    assert r.returncode == 2 and "invalid choice: 'q4'" in r.stderr


def test_bench_decode_fills_exactly_the_context(tiny_novocab):
    """tg n after depth d writes positions d .. d + n - 1: a context of d + n fits (the harness sizes it so),
    one more step does not."""
    llm = LLM(tiny_novocab, backend="cpu", max_seq=12)
    assert llm.bench_decode(12) > 0
    assert llm.bench_decode(4, depth=8) > 0
    with pytest.raises(ValueError, match="need 13 positions; the context holds 12"):
        llm.bench_decode(5, depth=8)


def test_serve_batch_slots_reach_the_server(tiny_model, monkeypatch, capsys):
    """--batch-slots (default 4 where the engine batches, else 1 with a note) is passed to the server; outside
    1..16 it is refused before a model loads."""
    import ninfer_numba.server.api as api
    from ninfer_numba.engine.llm import LLM
    seen = []
    monkeypatch.setattr(api, "serve", lambda llm, **kw: seen.append(kw["batch_slots"]))
    for extra, want in (([], 4), (["--batch-slots", "16"], 16)):
        assert main(["serve", "--model", tiny_model, "--backend", "cpu", *extra]) == 0
        assert seen.pop() == want
    monkeypatch.setattr(LLM, "batch_refusal", lambda self: "batched decode runs on one GPU")
    capsys.readouterr()
    assert main(["serve", "--model", tiny_model, "--backend", "cpu"]) == 0
    assert seen.pop() == 1 and "one request at a time (batched decode runs on one GPU)" in capsys.readouterr().err
    for bad in ("0", "17"):
        with pytest.raises(SystemExit):
            main(["serve", "--model", "missing.gguf", "--batch-slots", bad])
        assert "--batch-slots must be an integer in 1..16" in capsys.readouterr().err
