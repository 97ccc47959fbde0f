"""Qwen3.5 vocabulary metadata: shape of the GGUF keys, merge derivation, cache, and a GGUF write/read round trip."""
from collections import Counter

import gguf
import pytest

from ninfer_numba.formats.chat_template import DEFAULT_CHAT_TEMPLATE
from ninfer_numba.formats.gguf_reader import GGUFFile
from ninfer_numba.formats.qwen_vocab import (QWEN35_N_VOCAB, add_tokenizer_kv, derive_merges,
                                             qwen35_merges, qwen35_vocab_metadata)
from ninfer_numba.formats.tokenizer import Tokenizer, gpt2_string_to_bytes


@pytest.fixture(scope="module")
def meta():
    return qwen35_vocab_metadata()


def test_metadata_keys_and_sizes(meta):
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen35"
    assert len(tokens) == len(types) == QWEN35_N_VOCAB == 248320
    assert len(set(tokens)) == len(tokens)
    # 248,044 BPE tokens, 33 added (27 control, 6 user-defined markup tokens), 243 padding rows.
    assert Counter(types) == {1: 248044, 3: 27, 4: 6, 5: 243}
    assert [tokens[i] for i in (248044, 248046, 248055, 248068, 248069, 248076)] == [
        "<|endoftext|>", "<|im_end|>", "<|vision_pad|>", "<think>", "</think>", "<|audio_pad|>"]
    assert {tokens[i] for i, t in enumerate(types) if t == 4} == {
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
    assert tokens[248077] == "[PAD248077]" and tokens[-1] == "[PAD248319]"
    assert meta["tokenizer.ggml.eos_token_id"] == 248046
    assert meta["tokenizer.ggml.padding_token_id"] == 248055
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.chat_template"] == DEFAULT_CHAT_TEMPLATE
    # Byte-level form: single bytes are the first 256 ranks, space is stored as "Ġ".
    assert gpt2_string_to_bytes(tokens[220]) == b" " and tokens[220] == "Ġ"


def test_merges_are_consistent_with_the_vocabulary(meta):
    merges = meta["tokenizer.ggml.merges"]
    # Real Qwen3.5 GGUFs carry 247,587 merges (qwen35-format.md §6); the derivation reproduces the count.
    assert len(merges) == 247587
    rank = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"][:248044])}
    made = []
    for m in merges:
        left, right = m.split(" ")
        assert left in rank and right in rank
        made.append(rank[left + right])
    # One merge per token, listed in the order BPE applies them (rank of the token made).
    assert made == sorted(made) and len(set(made)) == len(made)


def test_padding_size_is_checked():
    assert len(qwen35_vocab_metadata(248077)["tokenizer.ggml.tokens"]) == 248077
    with pytest.raises(ValueError, match="smaller than the Qwen3.5 vocabulary"):
        qwen35_vocab_metadata(248076)


def test_derive_merges_on_a_toy_vocabulary():
    # "abc" (rank 3) is built from "ab", which has a higher rank (4): tiktoken still merges a+b first
    # (the only pair in the vocabulary), then ab+c. "xyz" has no pair in the vocabulary: no merge.
    ranked = [b"a", b"b", b"c", b"abc", b"ab", b"x", b"y", b"z", b"xyz", b"bc", b"cab"]
    assert derive_merges(ranked) == [(b"ab", b"c"), (b"a", b"b"), (b"b", b"c"), (b"c", b"ab")]


@pytest.mark.slow
def test_merge_cache_matches_a_fresh_derivation(tmp_path, meta):
    fresh = qwen35_merges(cache_dir=tmp_path)           # derives and writes the cache file
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("qwen35-merges-")
    assert qwen35_merges(cache_dir=tmp_path) == fresh   # read back from the file
    assert fresh == meta["tokenizer.ggml.merges"]       # the default-location cache agrees


def _write(path, kv) -> None:
    writer = gguf.GGUFWriter(str(path), "qwen35")
    add_tokenizer_kv(writer, kv)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_gguf_round_trip(tmp_path, meta):
    """The full vocabulary written with gguf.GGUFWriter reads back unchanged and builds the same tokenizer."""
    path = tmp_path / "vocab.gguf"
    _write(path, meta)
    kv = GGUFFile(path).kv
    for key, value in meta.items():
        assert kv[key] == value, key
    tok = Tokenizer.from_gguf_kv(kv)
    assert tok.encode("Hello! 毕老师！1 + 1 = 2") == [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17]


def test_gguf_value_types(tmp_path, meta):
    """Types llama.cpp checks strictly, read with the gguf package's reader (on a cut-down vocabulary: the
    package's reader takes minutes over 500k strings)."""
    small = dict(meta)
    small["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][:300]
    small["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:300]
    small["tokenizer.ggml.merges"] = meta["tokenizer.ggml.merges"][:10]
    _write(tmp_path / "small.gguf", small)
    fields = gguf.GGUFReader(tmp_path / "small.gguf").fields
    T = gguf.GGUFValueType
    expect = {"tokenizer.ggml.model": [T.STRING], "tokenizer.ggml.pre": [T.STRING],
              "tokenizer.ggml.tokens": [T.ARRAY, T.STRING], "tokenizer.ggml.token_type": [T.ARRAY, T.INT32],
              "tokenizer.ggml.merges": [T.ARRAY, T.STRING], "tokenizer.ggml.eos_token_id": [T.UINT32],
              "tokenizer.ggml.padding_token_id": [T.UINT32], "tokenizer.ggml.add_bos_token": [T.BOOL],
              "tokenizer.chat_template": [T.STRING]}
    for key, types in expect.items():
        assert fields[key].types == types, key
        assert fields[key].contents() == small[key], key
