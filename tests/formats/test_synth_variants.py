"""The synthetic writer's variants: one scale per matrix, and the same matrices stored as f16 / f32 floats."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ninfer_numba.model.weights import open_model
from ninfer_numba.synth import write_synthetic_gguf

MATRIX = "blk.0.ffn_up.weight"


def _weights(path):
    return open_model(str(path))


def test_one_block_scale_per_matrix(tmp_path):
    w = _weights(write_synthetic_gguf(tmp_path / "one.gguf", "tiny", vocab=False, block_scales="one"))
    raw = w.file.tensor_bytes(MATRIX).reshape(-1, 34)
    scales = raw[:, :2].copy().view(np.float16).ravel()
    assert w.info(MATRIX).ggml_type == QT.Q8_0 and np.unique(scales).size == 1
    varied = _weights(write_synthetic_gguf(tmp_path / "varied.gguf", "tiny", vocab=False))
    vraw = varied.file.tensor_bytes(MATRIX).reshape(-1, 34)
    assert np.unique(vraw[:, :2].copy().view(np.float16)).size > 100
    # the int8 draws are the same: only the scales differ
    np.testing.assert_array_equal(raw[:, 2:], vraw[:, 2:])


@pytest.mark.parametrize("matrix_type,qtype,rtol", [("f32", QT.F32, 0), ("f16", QT.F16, 2 ** -11)])
def test_float_files_hold_the_dequantized_matrices(tmp_path, matrix_type, qtype, rtol):
    q8 = _weights(write_synthetic_gguf(tmp_path / "q8.gguf", "tiny", vocab=False))
    fl = _weights(write_synthetic_gguf(tmp_path / f"{matrix_type}.gguf", "tiny", vocab=False,
                                       matrix_type=matrix_type))
    assert fl.info(MATRIX).ggml_type == qtype and fl.info("blk.0.ssm_a").ggml_type == QT.F32
    assert fl.file.kv["general.file_type"] == {"f32": 0, "f16": 1}[matrix_type]
    np.testing.assert_allclose(fl.dense(MATRIX), q8.dense(MATRIX), rtol=rtol, atol=0)
    np.testing.assert_array_equal(fl.dense("blk.0.ssm_a"), q8.dense("blk.0.ssm_a"))


def test_unknown_variants_are_refused(tmp_path):
    with pytest.raises(ValueError, match="block_scales"):
        write_synthetic_gguf(tmp_path / "x.gguf", "tiny", block_scales="per-row")
    with pytest.raises(ValueError, match="matrix_type"):
        write_synthetic_gguf(tmp_path / "x.gguf", "tiny", matrix_type="q4_0")
