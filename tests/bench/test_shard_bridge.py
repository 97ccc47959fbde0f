"""benchmarks/e2e/shard_bridge.py's overlap of traced shard bodies (the GPU run is the benchmark itself)."""
from benchmarks.e2e.shard_bridge import _overlap


def test_overlap_counts_time_with_two_bodies_running():
    rows = [(0, 0, 0.0, 10.0), (1, 0, 5.0, 15.0), (0, 1, 10.0, 20.0), (1, 1, 20.0, 30.0)]
    assert _overlap(rows) == 10.0                      # [5, 10] and [10, 15]
    assert _overlap([(0, 0, 0.0, 1.0), (1, 0, 1.0, 2.0)]) == 0.0
