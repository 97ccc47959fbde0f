"""The CUDA runner's prefill-graph bookkeeping (engine/cuda_runner.py ``_forward_chunk``), on the CPU.

A stand-in model counts forward calls (eager runs and the one inside each capture) and the position; a
stand-in graph records captures and launches (and can refuse a capture, as the driver does when something
inside is not capturable). The launches themselves run on the GPU in tests/model/test_gpu_model.py (replay
equals eager, bit for bit).
"""
import types

import pytest

from ninfer_numba.engine import cuda_runner


class _Model:
    def __init__(self):
        self.eager = 0

    def forward(self, t, st, logits_rows=1, **taps):
        self.eager += 1
        st.host_pos += t


class _Graph:
    refuse = False
    made: list = []

    def __init__(self, stream):
        self.launches, self.closed = 0, False
        _Graph.made.append(self)

    def capture(self):
        graph = self

        class _C:
            def __enter__(self):
                return graph

            def __exit__(self, exc_type, exc, tb):
                if _Graph.refuse:
                    raise RuntimeError("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
                return False
        return _C()

    def launch(self):
        self.launches += 1

    def close(self):
        self.closed = True


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(cuda_runner, "CudaGraph", _Graph)
    monkeypatch.setattr(cuda_runner, "SIMULATOR", False)
    _Graph.refuse, _Graph.made = False, []
    r = cuda_runner.CudaRunner.__new__(cuda_runner.CudaRunner)
    r.model, r.stream = _Model(), None
    r.engine = types.SimpleNamespace(prefill_graphs=True)
    r._prefill_graphs, r._prefill_seen, r._no_graph = {}, set(), set()
    return r


def test_eager_then_captured_then_replayed(runner):
    st = types.SimpleNamespace(host_pos=0)
    for _ in range(3):
        runner._forward_chunk(32, st, 1, {})
    # one eager forward, one inside the capture; the second and third calls launch the graph
    assert runner.model.eager == 2 and len(_Graph.made) == 1 and _Graph.made[0].launches == 2
    assert st.host_pos == 96                                  # counted once per call, captures included


def test_taps_and_off_stay_eager(runner):
    st = types.SimpleNamespace(host_pos=0)
    for _ in range(3):
        runner._forward_chunk(8, st, 1, {"tap": print})
    runner.engine.prefill_graphs = False
    for _ in range(3):
        runner._forward_chunk(16, st, 1, {})
    assert runner.model.eager == 6 and not _Graph.made and st.host_pos == 3 * (8 + 16)


def test_single_tokens_are_captured_like_any_length(runner):
    """A one-token rest (chunk_lengths) replays too: the decode graph captures forward(1) already."""
    st = types.SimpleNamespace(host_pos=0)
    for _ in range(3):
        runner._forward_chunk(1, st, 1, {})
    assert runner.model.eager == 2 and len(_Graph.made) == 1 and _Graph.made[0].launches == 2 and st.host_pos == 3


def test_warm_prefill_captures_every_piece_length_and_empties_the_state(runner):
    """warm_prefill: each piece length twice from an empty state (eager, then inside its capture, then the
    graph's first launch), the state empty after; a later forward of such a length replays at once."""
    resets = []
    st = types.SimpleNamespace(host_pos=0, max_seq=4096, reset=lambda stream: (resets.append(1),
                                                                           setattr(st, "host_pos", 0)))
    tokens = types.SimpleNamespace(copy_to_device=lambda a, stream=None: None)
    runner.model.buf = types.SimpleNamespace(t_max=2048, tokens=_Slicer(tokens))
    runner.stream = types.SimpleNamespace(synchronize=lambda: None)
    runner.warm_prefill(st)
    pieces = cuda_runner.piece_lengths()
    assert len(_Graph.made) == len(pieces) and all(g.launches == 1 for g in _Graph.made)
    assert runner.model.eager == 2 * len(pieces) and st.host_pos == 0 and len(resets) == 2 * len(pieces) + 1
    runner._forward_chunk(128, st, 1, {})
    assert runner.model.eager == 2 * len(pieces) and _Graph.made[pieces.index(128)].launches == 2


class _Slicer:
    """buf.tokens as the runner slices it: every slice is the same stand-in."""
    def __init__(self, part):
        self.part = part

    def __getitem__(self, key):
        return self.part


def test_a_refused_capture_falls_back_to_eager_for_good(runner, capsys):
    st = types.SimpleNamespace(host_pos=0)
    _Graph.refuse = True
    for _ in range(4):
        runner._forward_chunk(32, st, 1, {})
    # eager, the refused capture and its eager rerun, then eager twice more: no graph ever launched
    assert runner.model.eager == 5 and len(_Graph.made) == 1 and _Graph.made[0].launches == 0
    assert st.host_pos == 128 and "runs eagerly" in capsys.readouterr().err


def test_least_recently_used_length_is_dropped(runner, monkeypatch):
    monkeypatch.setattr(cuda_runner, "PREFILL_GRAPHS", 2)
    st = types.SimpleNamespace(host_pos=0)
    for t in (10, 10, 20, 20, 10, 30, 30):                    # 10 used last before 30 arrives: 20 goes
        runner._forward_chunk(t, st, 1, {})
    assert sorted(k[1] for k in runner._prefill_graphs) == [10, 30] and _Graph.made[1].closed
