"""benchmarks/e2e/shard_bridge.py's arithmetic and printing (the GPU run is the benchmark itself)."""
import subprocess
import sys

from benchmarks.e2e import shard_bridge
from benchmarks.e2e.shard_bridge import _overlap, handoff_gbps


def test_overlap_counts_time_with_two_bodies_running():
    rows = [(0, 0, 0.0, 10.0), (1, 0, 5.0, 15.0), (0, 1, 10.0, 20.0), (1, 1, 20.0, 30.0)]
    assert _overlap(rows) == 10.0                      # [5, 10] and [10, 15]
    assert _overlap([(0, 0, 0.0, 1.0), (1, 0, 1.0, 2.0)]) == 0.0


def test_handoff_gbps_counts_both_copies():
    assert handoff_gbps(4096, 8e-6) == 2 * 4 * 4096 / 8e-6 / 1e9     # 16 KiB out and back in 8 µs: 4.1 GB/s
    assert handoff_gbps(2048 * 4096, 2 * 4 * 2048 * 4096 / 50e9) == 50.0


def test_handoffs_printed_beside_the_measured_bridge(monkeypatch, capsys):
    timed = []

    def fake_time(n_floats):                           # 1 ns per float: 4 GB/s counting both copies
        timed.append(n_floats)
        return n_floats * 1e-9
    monkeypatch.setattr(shard_bridge, "_time_handoff", fake_time)
    shard_bridge._print_handoffs(n_embd=4096, chunk=2048, shards=3, bridge_s=(0.02, 30e-6), prompt=5000)
    lines = capsys.readouterr().out.splitlines()
    assert timed == [4096, 2048 * 4096]                # one decode row, one full prefill chunk
    assert "median of 20 graph replays of 50" in lines[0]
    assert lines[1].split() == ["decode", "row", "[1,", "4096]", "f32", "0.016", "MB", "4.1", "us", "8.0", "GB/s;",
                                "2", "per", "token:", "8.2", "us", "of", "the", "+30.0", "us", "bridge"]
    # 5000 tokens in chunks of 2048: 3 chunks, each crossing 2 boundaries
    assert lines[2].split()[4:] == ["f32", "33.554", "MB", "8388.6", "us", "8.0", "GB/s;", "6", "per", "5000-token",
                                    "prefill:", "50331.6", "us", "of", "the", "+20000.0", "us", "bridge"]


def test_help_runs_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "benchmarks.e2e.shard_bridge", "--help"], capture_output=True,
                         text=True, check=True)
    assert "--prefill-chunk" in out.stdout and "--model MODEL" in out.stdout
