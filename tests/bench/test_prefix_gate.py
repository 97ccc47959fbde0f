"""benchmarks/e2e/prefix_gate.py on the tiny model (CPU): a chat's second turn after another client reuses
the first turn's history, and clients sharing a system prompt reuse its snapshot."""
import re

from benchmarks.e2e.prefix_gate import main


def test_second_turn_and_shared_system_prompt_reuse(capsys):
    assert main(["--history", "300", "--clients", "3"]) == 0
    out = capsys.readouterr().out
    turn2 = re.search(r"turn 2 \(after another client\): (\d+) prompt tokens, (\d+) cached", out)
    assert turn2 and int(turn2.group(2)) >= 300 and int(turn2.group(1)) - int(turn2.group(2)) < 40
    cached = [int(x) for x in re.search(r"cached tokens \[([\d, ]+)\]", out).group(1).split(",")]
    assert cached[0] == 0 and all(c >= 300 for c in cached[1:])
