"""benchmarks/e2e/soak.py: a short soak of the tiny model's CPU server (every kind of request, clients that
leave), and the memory verdict on made-up samples."""
import json

import pytest

from benchmarks.e2e.soak import KINDS, memory_growth, main
from tests.server.helpers import free_port


def test_a_short_soak_has_no_failures(tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert main(["--requests", "70", "--clients", "6", "--sample-every", "2", "--max-tokens", "4",
                 "--port", str(free_port()), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["failures"] == [] and r["health_after"] == 200 and r["flat"]
    assert sum(r["outcomes"].values()) == 70 and r["outcomes"].get("200", 0) > 20
    assert r["outcomes"].get("left", 0) > 0                         # some clients did leave mid-request
    assert {k.split()[0] for k in r["by_kind"]} == set(KINDS)       # every kind of request was sent
    assert "0 failures" in capsys.readouterr().out


def test_memory_growth_compares_the_medians_of_the_first_and_last_thirds():
    flat = [(n, 400.0 + (30 if n % 30 == 0 else 0)) for n in range(10, 310, 10)]     # swings, no trend
    growth, base, end = memory_growth(flat, warmup=60)
    assert growth == 0 and base == end == 400.0
    leak = [(n, 400.0 + n / 5) for n in range(10, 310, 10)]                          # 2 MB every 10 requests
    growth, base, end = memory_growth(leak, warmup=60)
    assert growth == pytest.approx(32.0) and end > base
    with pytest.raises(SystemExit, match="memory samples"):
        memory_growth(leak[:7], warmup=60)
