"""benchmarks/e2e/kv_logits.py on the tiny model (CPU): every type's figures, teacher-forced rows aligned
with the float16 run's, and the report's bookkeeping."""
import json

import numpy as np
import pytest

from benchmarks.e2e.kv_logits import compare, main


def test_every_type_is_compared_on_the_same_rows(tiny_novocab, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--model", tiny_novocab, "--backend", "cpu", "--kv-types", "k3v3,q8", "--prompt", "40",
                 "--gen", "6", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["types"]) == {"k3v3", "q8"}
    q8, k3 = r["types"]["q8"], r["types"]["k3v3"]
    assert 0 < q8["rel_error"] < k3["rel_error"] < 0.1 and 0 <= k3["greedy_same"] <= q8["greedy_same"] <= 6
    assert "q8: rel" in capsys.readouterr().out


def test_compare_counts_rows_and_greedy_picks():
    base = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0]]           # 5 rows: 3 prompt, 2 decode
    ours = base.copy()
    ours[4] = [0, 0, 1, 0]                                        # the last decode row picks another token
    fig = compare(ours, base, n_prompt=3)
    assert fig["top1_agreement"] == 0.8 and fig["greedy_same"] == 2 and fig["rel_error"] > 0
    assert fig["rel_error_decode"] == pytest.approx(np.sqrt(2) / np.sqrt(2))


def test_unknown_types_are_refused(tiny_novocab):
    with pytest.raises(SystemExit, match="kv-types"):
        main(["--model", tiny_novocab, "--kv-types", "f16"])
