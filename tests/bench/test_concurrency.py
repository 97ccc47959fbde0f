"""benchmarks/e2e/concurrency.py on the tiny model (CPU server in a subprocess): N streams at once each get
exactly --max-tokens tokens, and the report and table carry every N."""
import json

from benchmarks.e2e.concurrency import main, table
from ninfer_numba.synth import write_synthetic_gguf
from tests.server.helpers import free_port


def test_streams_at_once_on_the_tiny_model(tmp_path, capsys):
    model = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", seed=0)
    out = tmp_path / "r.json"
    assert main(["--model", str(model), "--backend", "cpu", "--streams", "1,3", "--prompt-tokens", "24",
                 "--max-tokens", "5", "--port", str(free_port()), "--no-llamacpp", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["streams"] for r in report["ours"]] == [1, 3]
    for r in report["ours"]:
        assert r["tokens"] == 5 * r["streams"] and len(r["per_stream_tps"]) == r["streams"]
        assert r["aggregate_tps"] > 0 and r["wall_s"] > 0
        # every client is made before any request goes out: the sends are ms apart, not a client's setup
        assert 0 <= r["send_spread_s"] < 0.05 and 0 < r["slowest_stream_tps"] <= r["median_stream_tps"]
        # the server's phases of each request came back with its usage: the batch's median and max
        ms = r["server_ms"]
        assert set(ms) == {"prepare_ms", "queue_ms", "prefill_ms", "first_token_ms"}
        assert all(0 <= v["median"] <= v["max"] for v in ms.values()) and ms["prefill_ms"]["median"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "| 1 |" in printed and "| 3 |" in printed


def test_table_beside_llamacpp_rows():
    ours = [{"streams": 1, "aggregate_tps": 100.0, "decode_aggregate_tps": 110.0, "median_stream_tps": 110.0,
             "slowest_stream_tps": 110.0},
            {"streams": 4, "aggregate_tps": 360.0, "decode_aggregate_tps": 396.0, "median_stream_tps": 99.0,
             "slowest_stream_tps": 88.0}]
    llama = [{"streams": 1, "aggregate_tps": 80.0, "per_stream_tps": 80.0},
             {"streams": 4, "aggregate_tps": 300.0, "per_stream_tps": 75.0}]
    lines = table(ours, llama).splitlines()
    assert lines[2] == "| 1 | 100.0 (1.00x) | 110.0 (1.00x) | 110.0 | 1.00 | 80.0 (1.00x) | 80.0 |"
    assert lines[3] == "| 4 | 360.0 (3.60x) | 396.0 (3.60x) | 99.0 | 0.80 | 300.0 (3.75x) | 75.0 |"
    assert table(ours[1:], []).splitlines()[2] == "| 4 | 360.0 | 396.0 | 99.0 | nan | nan | nan |"
