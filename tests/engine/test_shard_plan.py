"""The split by layers (engine/shard_plan.py): contiguous ranges that minimize the largest shard's per-token
bytes (checked against every possible cut), the embedding first and the head last, costs read from a
file's tensor table, and `ninfer info --gpus`."""
import itertools

import numpy as np
import pytest

from ninfer_numba.cli import main
from ninfer_numba.engine.shard_plan import layer_costs, parse_gpus, plan_shards
from ninfer_numba.model.weights import open_model


def test_parse_gpus():
    assert parse_gpus("2") == [0, 1] and parse_gpus("0,0") == [0, 0] and parse_gpus(" 1,3 ") == [1, 3]
    for bad in ("x", "0", "-1,0", ",", "1.5"):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(bad)


def _brute_force(layers, head, row, k):
    """The smallest largest-shard cost over every way to cut len(layers) layers into k non-empty ranges."""
    n, best = len(layers), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        worst = max(sum(layers[b[s]:b[s + 1]]) + (row if s == 0 else 0) + (head if s == k - 1 else 0)
                    for s in range(k))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_optimal_contiguous_and_complete(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(4, 10)), int(rng.integers(1, 4))
    layers = rng.integers(50, 150, n).tolist()
    head, row = int(rng.integers(0, 400)), int(rng.integers(0, 5))
    plan = plan_shards(layers, head, 1000, row, list(range(k)))
    assert [s.first_layer for s in plan] == [0] + [s.end_layer for s in plan[:-1]] and plan[-1].end_layer == n
    assert all(len(s.layers) >= 1 for s in plan)
    assert [s.embedding for s in plan] == [True] + [False] * (k - 1)
    assert [s.head for s in plan] == [False] * (k - 1) + [True]
    assert max(s.step_bytes for s in plan) == _brute_force(layers, head, row, k)
    assert sum(s.weight_bytes for s in plan) == sum(layers) + head + 1000


def test_ties_give_earlier_shards_more_layers_and_shards_may_share_a_device():
    plan = plan_shards([10] * 8, 20, 0, 0, [0, 0])        # the head weighs two layers: 5 | 3 + head
    assert [(s.device, s.first_layer, s.end_layer) for s in plan] == [(0, 0, 5), (0, 5, 8)]
    assert [s.step_bytes for s in plan] == [50, 50]
    tie = plan_shards([10, 1, 10], 0, 0, 0, [1, 0])       # 10 | 11 and 11 | 10 both cost 11
    assert [(s.device, s.first_layer, s.end_layer) for s in tie] == [(1, 0, 2), (0, 2, 3)]
    with pytest.raises(ValueError, match="at least one layer"):
        plan_shards([10] * 3, 0, 0, 0, [0, 1, 2, 3])


def test_costs_from_the_file_and_a_tied_head_held_once(tiny_model, tiny_untied):
    for path in (tiny_model, tiny_untied):
        w = open_model(path)
        sizes = {n: t.nbytes for n, t in w.file.tensors.items()}
        layers, head, embd, row = layer_costs(sizes, w.config)
        assert len(layers) == w.config.n_layer and min(layers) > 0 and row * w.config.n_vocab >= embd
        one = plan_shards(layers, head, embd, row, [0], tied=w.config.tied_embeddings)[0]
        assert one.weight_bytes == sum(sizes.values())     # every tensor once, the tied table included
        two = plan_shards(layers, head, embd, row, [0, 1], tied=w.config.tied_embeddings)
        assert two[1].weight_bytes >= head                # the last shard carries the head (a copy if tied)


def test_info_prints_the_plan(tiny_model, capsys):
    assert main(["info", "--model", tiny_model, "--gpus", "0,0"]) == 0
    out = capsys.readouterr().out
    assert "split by layers over 2 shards" in out
    assert "shard 0 on GPU 0: embedding, layers 0-" in out and "attention); " in out
    assert "shard 1 on GPU 0: layers " in out and ", head;" in out
    assert main(["info", "--model", tiny_model, "--gpus", "9"]) == 2      # 9 shards for 4 layers
    assert "at least one layer" in capsys.readouterr().err
