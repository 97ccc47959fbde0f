"""Files as llama.cpp's converter writes them for qwen35 (convert_hf_to_gguf.py, Qwen3_5TextModel, in the
llama.cpp that the harness builds) load and compute the same model as the plain synthetic file.

The converter writes, beyond the keys our synthetic files carry: general.* provenance, file type and
quantization version, a gpt2 tokenizer with pre-tokenizer, token types, merges, special ids and chat
templates (default and named); BF16 matrices (its default out-type) with F32 norms, conv and 1-D tensors;
no output.weight when the embeddings are tied. Newer converters append multi-token-prediction blocks
(``nextn_predict_layers``, counted in block_count, tensors under the last ``blk.N.``), which the loader
leaves unread. Keys it writes only for files this engine cannot run right (rope.scaling.*) are refused.
"""
import numpy as np
import pytest

from ninfer_numba.config import ModelFormatError
from ninfer_numba.model.reference import ReferenceModel
from ninfer_numba.model.weights import open_model
from tests.gguf_factory import QT, TinySpec, tensors_for, write_gguf

TOKENS = [3, 17, 200, 5, 91, 310, 42, 0]
ARCH = "qwen35."


def _vocab(n: int) -> list[str]:
    """Byte-level BPE tokens the merge list below is consistent with (the engine's tokenizer checks it)."""
    return ["a", "b", "ab"] + [f"<t{i}>" for i in range(n - 5)] + ["<|im_start|>", "<|im_end|>"]


def _converter_keys(s: TinySpec, n_mtp: int):
    def add(w):
        w.add_type("model")
        w.add_name("Qwen3.5 Tiny")
        w.add_basename("Qwen3.5")
        w.add_size_label("tiny")
        w.add_license("apache-2.0")
        w.add_tags(["text-generation"])
        w.add_languages(["en"])
        w.add_file_type(32)                              # MOSTLY_BF16
        w.add_quantization_version(2)
        if n_mtp:
            w.add_uint32(ARCH + "block_count", s.n_layer + n_mtp)
            w.add_uint32(ARCH + "nextn_predict_layers", n_mtp)
        w.add_tokenizer_pre("qwen35")
        w.add_token_types([1] * (s.n_vocab - 2) + [3, 3])
        w.add_token_merges(["a b"])
        w.add_eos_token_id(s.n_vocab - 1)
        w.add_pad_token_id(s.n_vocab - 1)
        w.add_bos_token_id(s.n_vocab - 1)
        w.add_add_bos_token(False)
        w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
        w.add_string("tokenizer.chat_template.tool_use", "{{ messages }}")
    return add


def _mtp_tensors(s: TinySpec, block: int, rng) -> dict[str, np.ndarray]:
    """A multi-token-prediction block as newer converters append it: a full attention block plus the
    nextn projections (names as llama.cpp's gguf-py NEXTN_* tensors)."""
    e, d = s.n_embd, s.head_dim
    b = f"blk.{block}."
    mat = lambda n, k: (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)   # noqa: E731
    vec = lambda n: np.ones(n, np.float32)                                             # noqa: E731
    return {b + "attn_norm.weight": vec(e), b + "post_attention_norm.weight": vec(e),
            b + "attn_q.weight": mat(2 * d * s.n_head, e), b + "attn_k.weight": mat(d * s.n_head_kv, e),
            b + "attn_v.weight": mat(d * s.n_head_kv, e), b + "attn_output.weight": mat(e, d * s.n_head),
            b + "ffn_gate.weight": mat(s.n_ff, e), b + "ffn_up.weight": mat(s.n_ff, e),
            b + "ffn_down.weight": mat(e, s.n_ff), b + "nextn.eh_proj.weight": mat(e, 2 * e),
            b + "nextn.enorm.weight": vec(e), b + "nextn.hnorm.weight": vec(e),
            b + "nextn.shared_head_norm.weight": vec(e)}


def _logits(path) -> np.ndarray:
    m = ReferenceModel(open_model(path, log=lambda _: None))
    return m.forward(TOKENS, m.new_state(len(TOKENS) + 4))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("n_mtp", [0, 1], ids=["no-mtp", "mtp1"])
def test_converter_file_computes_the_plain_model(tmp_path, tied, n_mtp):
    s = TinySpec(tied=tied)
    t = tensors_for(s, np.random.default_rng(5))
    plain = write_gguf(tmp_path / "plain.gguf", s, t, matrix_type=QT.BF16, vocab_tokens=_vocab(s.n_vocab))
    full = dict(t, **(_mtp_tensors(s, s.n_layer, np.random.default_rng(6)) if n_mtp else {}))
    conv = write_gguf(tmp_path / "conv.gguf", s, full, matrix_type=QT.BF16, vocab_tokens=_vocab(s.n_vocab),
                      skip_keys=("block_count",) if n_mtp else (), extra_kv=_converter_keys(s, n_mtp))
    if n_mtp:
        notes = []
        w = open_model(conv, log=notes.append)
        assert (w.config.n_layer, w.config.mtp_layers) == (s.n_layer, 1)
        assert len(notes) == 1 and "13 tensors of 1 multi-token-prediction block" in notes[0], notes
    assert open_model(conv, log=lambda _: None).config.tied_embeddings == tied
    np.testing.assert_array_equal(_logits(conv), _logits(plain))


def _write(tmp_path, spec, extra, skip=()):
    return write_gguf(tmp_path / "m.gguf", spec, tensors_for(spec, np.random.default_rng(3)),
                      skip_keys=skip, extra_kv=extra)


@pytest.mark.parametrize("kind,factor,ok", [("none", 1.0, True), ("linear", 1.0, True), ("yarn", 4.0, False),
                                            ("linear", 2.0, False)])
def test_rope_scaling_is_refused_unless_it_is_none(tmp_path, kind, factor, ok):
    def extra(w):
        w.add_string(ARCH + "rope.scaling.type", kind)
        w.add_float32(ARCH + "rope.scaling.factor", factor)
        w.add_uint32(ARCH + "rope.scaling.original_context_length", 4096)
    p = _write(tmp_path, TinySpec(), extra)
    if ok:
        assert open_model(p).config.n_layer == 4
    else:
        with pytest.raises(ModelFormatError, match="RoPE scaling .* is not supported"):
            open_model(p)


def test_scalar_rope_sections_are_broadcast(tmp_path):
    s = TinySpec()
    def extra(w):
        w.add_rope_dimension_count(s.n_rot)
        w.add_rope_freq_base(s.rope_base)
        w.add_int32(ARCH + "rope.dimension_sections", 4)
    assert open_model(_write(tmp_path, s, extra, skip=("rope",))).config.rope_sections == (4, 4, 4, 4)


@pytest.mark.parametrize("values,match", [([1, 1, 1, 1], None), ([1, 1, 1], "expected one per block"),
                                          ([1, 1, 1, 1, 1], "expected one per block")])
def test_per_layer_arrays_need_one_entry_per_block(tmp_path, values, match):
    def extra(w):
        w.add_array(ARCH + "attention.head_count_kv", values)
    p = _write(tmp_path, TinySpec(), extra, skip=("head_count_kv",))
    if match is None:
        assert open_model(p).config.n_head_kv == 1
    else:
        with pytest.raises(ModelFormatError, match=match):
            open_model(p)


def test_nextn_layers_must_leave_a_model(tmp_path):
    def extra(w):
        w.add_uint32(ARCH + "nextn_predict_layers", 4)
    with pytest.raises(ModelFormatError, match="nextn_predict_layers"):
        open_model(_write(tmp_path, TinySpec(), extra))


def test_split_file_is_refused_with_the_merge_command(tmp_path):
    def extra(w):
        w.add_uint16("split.no", 0)
        w.add_uint16("split.count", 3)
        w.add_int32("split.tensors.count", 200)
    with pytest.raises(ModelFormatError, match="split into 3 files.*llama-gguf-split --merge"):
        open_model(_write(tmp_path, TinySpec(), extra))


@pytest.mark.gpu
def test_converter_file_runs_on_the_gpu(tmp_path):
    """The converter-like file (BF16 matrices requantized to Q8_0 at load, an MTP block left unread) gives
    the GPU the same logits as the plain file of the same weights (shapes of tests/model/test_gpu_model.py)."""
    from ninfer_numba import LLM
    from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
    from tests.model.test_gpu_model import SPEC
    if SIMULATOR or not gpu_available():
        pytest.skip("needs a CUDA GPU")
    t = tensors_for(SPEC, np.random.default_rng(8))
    vocab = _vocab(SPEC.n_vocab)
    plain = write_gguf(tmp_path / "plain.gguf", SPEC, t, matrix_type=QT.BF16, vocab_tokens=vocab,
                       extra_kv=_converter_keys(SPEC, 0))          # the engine needs the tokenizer keys
    mtp = _mtp_tensors(SPEC, SPEC.n_layer, np.random.default_rng(6))
    conv = write_gguf(tmp_path / "conv.gguf", SPEC, dict(t, **mtp), matrix_type=QT.BF16, vocab_tokens=vocab,
                      skip_keys=("block_count",), extra_kv=_converter_keys(SPEC, 1))
    logits = [LLM(p, backend="cuda", max_seq=64, prefill_chunk=32).logits(TOKENS) for p in (plain, conv)]
    np.testing.assert_array_equal(logits[1], logits[0])
    assert np.isfinite(logits[0]).all()
