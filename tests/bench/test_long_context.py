"""benchmarks/e2e/long_context.py on the tiny model (CPU): one prefill in pieces, decodes from that depth."""
import json

from benchmarks.e2e.long_context import main


def test_prefill_once_then_decode_reps(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--model", tiny_model, "--backend", "cpu", "--kv-type", "k3v3", "--depth", "50",
                 "--piece", "20", "--gen", "3", "--reps", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["max_seq"] == 56 and len(r["decode_tps"]) == 2 and all(t > 0 for t in r["decode_tps"])
    assert r["prefill_tps"] > 0 and r["kv_formula_bytes"] > 0 and r["filled"] == 0
    err = capsys.readouterr().err
    assert "prefilled 20 of 50" in err and "prefilled 50 of 50" in err and "from depth 53" in err


def test_a_filled_depth_prefills_only_the_rest(tiny_model, tmp_path, capsys):
    """--fill 40 of a depth of 50: the cache holds 40 random tokens, 10 are prefilled at depth 40, decode
    starts at 50; the report and its line say so."""
    out = tmp_path / "r.json"
    assert main(["--model", tiny_model, "--backend", "cpu", "--depth", "50", "--fill", "40", "--gen", "2",
                 "--reps", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["filled"] == 40 and r["decode_tps"][0] > 0
    captured = capsys.readouterr()
    assert "filled 40 tokens" in captured.err and "prefilled 10 of 10 tokens (depth 50)" in captured.err
    assert "(40 of them filled at random)" in captured.out
