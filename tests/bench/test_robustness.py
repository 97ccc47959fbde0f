"""benchmarks/e2e/robustness.py's server figures on the CPU: every malformed request counted with its status
and error shape, the oversized and deep bodies refused, /health polled meanwhile."""
from benchmarks.e2e import robustness


def test_server_figures_count_every_case(capsys):
    from tests.server.test_server_errors import CHAT_CASES
    robustness.main(["--skip-fuzz"])
    out = capsys.readouterr().out
    n = len(CHAT_CASES)
    assert f"{n} malformed chat requests" in out and f"{n} with the expected status" in out
    assert "20 MB body: 413 in" in out and "JSON nested 100,000 deep: 400 in" in out
    assert "/health meanwhile" in out
