"""llama.cpp as a gate (benchmarks/llamacpp_logits.py): our float reference and our GPU engine against
llama.cpp on the same files, held to GATE_BOUNDS.

On the GPU (where the harness has built llama.cpp): float files (F32, F16, tiny shape) on both sides, and
the 0.8B shape in Q8_0 from both block-scale generators on the GPU side. Any change to a kernel the forward
uses runs here with the GPU suite. The bookkeeping (matrix type, comparison, refusals) is tested on the CPU.
"""
import numpy as np
import pytest

from benchmarks.llamacpp_logits import GATE_BOUNDS, compare, gate, matrix_type
from ninfer_numba.synth import write_synthetic_gguf


@pytest.mark.parametrize("kind,expect", [("q8_0", "Q8_0"), ("f16", "F16"), ("f32", "F32")])
def test_matrix_type_names_the_projection_storage(tmp_path, kind, expect):
    path = write_synthetic_gguf(tmp_path / f"{kind}.gguf", "tiny", vocab=False, matrix_type=kind)
    assert matrix_type(str(path)) == expect and expect in GATE_BOUNDS


def test_compare_reports_distance_and_top1():
    theirs = np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]], np.float32)
    ours = theirs.copy()
    ours[1] = [0.0, 3.0, 1.0]                       # the second row's argmax moves
    fig = compare(ours, theirs)
    assert fig["top1_agreement"] == 0.5 and fig["first_row_rel_error"] == 0.0
    assert fig["worst_row_rel_error"] == pytest.approx(np.sqrt(18) / np.sqrt(10))
    with pytest.raises(RuntimeError, match="llama.cpp returned"):
        compare(ours[:1], theirs)


def test_gate_refuses_sides_without_a_bound(tmp_path):
    path = write_synthetic_gguf(tmp_path / "q8.gguf", "tiny", vocab=False)
    with pytest.raises(ValueError, match="no gate bound for the cpu side on Q8_0"):
        gate(tmp_path / "no-tool", str(path), ["cpu"])


def _tool():
    from benchmarks.llamacpp import DEFAULT_CACHE, find_llama_bench
    from benchmarks.llamacpp_logits import build_tool
    bench = find_llama_bench(None, DEFAULT_CACHE)
    if bench is None:
        pytest.skip("llama.cpp is not built here (python -m benchmarks.llamacpp build)")
    return build_tool(bench, DEFAULT_CACHE / "src")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,kind,scales,sides", [
    ("tiny", "f32", "varied", ["cpu", "cuda"]), ("tiny", "f16", "varied", ["cpu", "cuda"]),
    ("0.8b", "q8_0", "varied", ["cuda"]), ("0.8b", "q8_0", "one", ["cuda"])])
def test_llamacpp_gate(tmp_path, shape, kind, scales, sides):
    tool = _tool()
    path = write_synthetic_gguf(tmp_path / "m.gguf", shape, seed=7, vocab=False, matrix_type=kind,
                                block_scales=scales)
    report = gate(tool, str(path), sides, tokens=256)
    print(report)
    for side, fig in report["sides"].items():
        assert fig["passed"], (side, fig)
