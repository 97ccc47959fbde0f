"""GGUF loading: good files load with the right config; each kind of bad file fails with a clear message."""
import gguf
import numpy as np
import pytest

from ninfer_numba.config import ModelFormatError
from ninfer_numba.formats.gguf_reader import GGUFFile
from ninfer_numba.formats.quants import dequantize, quantize_q8_0, split_q8_0
from ninfer_numba.model.weights import open_model
from tests.gguf_factory import QT, TinySpec, tensors_for, write_gguf


@pytest.fixture
def spec():
    return TinySpec()


@pytest.fixture
def tensors(spec):
    return tensors_for(spec, np.random.default_rng(3))


def test_synthetic_tiny_loads(tiny_novocab):
    w = open_model(tiny_novocab)
    c = w.config
    assert (c.n_embd, c.n_layer, c.n_vocab, c.tied_embeddings) == (64, 4, 248320, True)
    assert c.attention_layers == [3] and c.gdn_layers == [0, 1, 2]
    assert w.output_name == "token_embd.weight"


def test_untied_and_odd_shapes_load(tmp_path, spec, tensors):
    p = write_gguf(tmp_path / "m.gguf", spec, tensors, matrix_type=QT.Q8_0)
    w = open_model(p)
    c = w.config
    assert (c.head_dim, c.ssm_state, c.ssm_heads, c.tied_embeddings) == (48, 24, 4, False)
    assert w.info("blk.0.attn_qkv.weight").ggml_type == QT.Q8_0
    assert w.info("blk.0.ssm_a").ggml_type == QT.F32


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0])
def test_dequantize_matches_gguf_package(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((7, 96)) * 3).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "d.gguf"), "qwen35")
    if qtype in (QT.F32, QT.F16):
        w.add_tensor("x", x.astype(np.float32 if qtype == QT.F32 else np.float16))
    else:
        w.add_tensor("x", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    f = GGUFFile(tmp_path / "d.gguf")
    t = f.tensors["x"]
    ours = dequantize(f.tensor_bytes("x"), t.ggml_type, t.shape)
    theirs = gguf.quants.dequantize(np.asarray(f.tensor_bytes("x")), qtype).reshape(t.shape)
    assert t.shape == (7, 96)
    np.testing.assert_array_equal(ours, theirs)       # data movement and dequant: exact


def test_q8_split_and_quantize_match_gguf(rng):
    x = (rng.standard_normal((5, 64)) * 2).astype(np.float32)
    raw = gguf.quants.quantize(x, QT.Q8_0)
    q, d = split_q8_0(raw.reshape(-1), (5, 64))
    q2, d2 = quantize_q8_0(x)
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(d, d2)
    assert q.dtype == np.int8 and d.dtype == np.float16 and d.shape == (5, 2)


def _error(path) -> str:
    with pytest.raises(ModelFormatError) as e:
        open_model(str(path))
    return str(e.value)


def test_missing_file(tmp_path):
    assert "not found" in _error(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"hello world, this is not a model file")
    assert "not a GGUF" in _error(tmp_path / "x.gguf")


def test_truncated(tmp_path, tiny_novocab):
    data = open(tiny_novocab, "rb").read()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) // 2])
    assert "truncated" in _error(tmp_path / "t.gguf")
    (tmp_path / "h.gguf").write_bytes(data[:100])
    assert "truncated" in _error(tmp_path / "h.gguf")


def test_other_architecture(tmp_path, spec, tensors):
    msg = _error(write_gguf(tmp_path / "a.gguf", spec, tensors, arch="llama"))
    assert "unsupported architecture 'llama'" in msg and "qwen35" in msg


def test_other_quant_type(tmp_path, spec, tensors):
    msg = _error(write_gguf(tmp_path / "q.gguf", spec, tensors, matrix_type=QT.Q4_0))
    assert "Q4_0" in msg and "Q8_0" in msg


def test_missing_key(tmp_path, spec, tensors):
    assert "required metadata key qwen35.ssm." in _error(write_gguf(tmp_path / "k.gguf", spec, tensors, skip_keys=("ssm",)))


def test_missing_tensor(tmp_path, spec, tensors):
    del tensors["blk.1.ssm_a"]
    assert "blk.1.ssm_a is missing" in _error(write_gguf(tmp_path / "m.gguf", spec, tensors))


def test_misshaped_tensor(tmp_path, spec, tensors):
    tensors["blk.0.ffn_up.weight"] = tensors["blk.0.ffn_up.weight"][:64]
    msg = _error(write_gguf(tmp_path / "s.gguf", spec, tensors))
    assert "blk.0.ffn_up.weight has shape [64, 64]" in msg


def test_extra_tensor(tmp_path, spec, tensors):
    tensors["mtp.0.weight"] = np.zeros(4, np.float32)
    assert "unexpected tensors" in _error(write_gguf(tmp_path / "e.gguf", spec, tensors))


def test_vocab_mismatch(tmp_path, spec, tensors):
    msg = _error(write_gguf(tmp_path / "v.gguf", spec, tensors, vocab_tokens=[f"t{i}" for i in range(10)]))
    assert "vocabulary" in msg or "shape" in msg
