"""benchmarks/e2e/long_context.py on the tiny model (CPU): one prefill in pieces, decodes from that depth."""
import json

from benchmarks.e2e.long_context import main


def test_prefill_once_then_decode_reps(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--model", tiny_model, "--backend", "cpu", "--kv-type", "k3v3", "--depth", "50",
                 "--piece", "20", "--gen", "3", "--reps", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["max_seq"] == 56 and len(r["decode_tps"]) == 2 and all(t > 0 for t in r["decode_tps"])
    assert r["prefill_tps"] > 0 and r["kv_formula_bytes"]["scratch"] > 0
    err = capsys.readouterr().err
    assert "prefilled 20 of 50" in err and "prefilled 50 of 50" in err and "from depth 53" in err
