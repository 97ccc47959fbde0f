"""benchmarks/timing.append_jsonl: the JSON-lines records every kernel benchmark appends with --out."""
import json

from benchmarks.timing import append_jsonl


def test_append_jsonl_adds_fields_and_appends(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_jsonl(str(path), [{"kernel": "a", "us": 1.5}], model="9b")
    append_jsonl(str(path), [{"kernel": "b", "us": 2.0, "model": "27b"}], model="9b")   # a row's own key wins
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"model": "9b", "kernel": "a", "us": 1.5}, {"model": "27b", "kernel": "b", "us": 2.0}]


def test_append_jsonl_without_path_writes_nothing(tmp_path):
    append_jsonl(None, [{"kernel": "a"}])
    append_jsonl("", [{"kernel": "a"}])
    assert list(tmp_path.iterdir()) == []
