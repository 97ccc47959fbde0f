"""Tokenizer API: special tokens, decoding rules, the incremental decoder, bad metadata, a hand-made vocabulary."""
import random

import pytest

from ninfer_numba.formats.qwen_vocab import qwen35_vocab_metadata
from ninfer_numba.formats.tokenizer import (IncrementalDecoder, Tokenizer, bytes_to_gpt2_string,
                                            gpt2_byte_to_unicode, gpt2_string_to_bytes)

IM_START, IM_END, ENDOFTEXT, THINK, END_THINK, TOOL_CALL = 248045, 248046, 248044, 248068, 248069, 248058


@pytest.fixture(scope="module")
def qwen():
    return Tokenizer.from_gguf_kv(qwen35_vocab_metadata())


@pytest.fixture(scope="module")
def byte_id() -> dict[int, int]:
    """Id of each single-byte token, found by its stored GPT-2 string (most are not valid UTF-8 alone)."""
    index = {t: i for i, t in enumerate(qwen35_vocab_metadata()["tokenizer.ggml.tokens"])}
    return {b: index[bytes_to_gpt2_string(bytes([b]))] for b in range(256)}


def test_byte_map_is_a_bijection():
    table = gpt2_byte_to_unicode()
    assert len(set(table.values())) == 256 and table[ord("A")] == "A" and table[ord(" ")] == "Ġ"
    data = bytes(range(256))
    assert gpt2_string_to_bytes(bytes_to_gpt2_string(data)) == data


def test_vocabulary_facts(qwen):
    assert qwen.n_vocab == 248320
    assert qwen.eos_ids == {IM_END, ENDOFTEXT}
    assert len(qwen.special_ids) == 27 and IM_START in qwen.special_ids and THINK not in qwen.special_ids
    assert len(qwen.added_ids) == 33 and {THINK, END_THINK, TOOL_CALL} <= qwen.added_ids
    assert qwen.token_id("<think>") == THINK and qwen.token_id("<|im_end|>") == IM_END
    assert qwen.token_id("Hello") == 9419 and qwen.token_id(" world") is not None
    assert qwen.token_id("Hello world, this is not one token") is None
    assert qwen.token_id("[PAD248100]") is None          # padding rows are not tokens of the vocabulary
    assert qwen.id_to_piece(9419) == "Hello" and qwen.id_to_piece(IM_END) == "<|im_end|>"
    assert qwen.id_to_piece(248100) == "" and qwen.decode([9419, 248100, 0]) == "Hello!"


def test_special_tokens_are_whole_tokens_only_when_parsed(qwen):
    text = "<|im_start|>user\n<think>x</think><tool_call><|im_end|>"
    ids = qwen.encode(text)
    assert ids[0] == IM_START and ids[-1] == IM_END and {THINK, END_THINK, TOOL_CALL} <= set(ids)
    literal = qwen.encode(text, parse_special=False)
    assert not set(literal) & qwen.added_ids
    assert qwen.decode(literal) == text and qwen.decode(ids) == text


def test_skip_special_drops_control_tokens_but_keeps_markup(qwen):
    ids = qwen.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nOK<|im_end|>")
    assert qwen.decode(ids, skip_special=True) == "assistant\n<think>\nhm\n</think>\n\nOK"


def test_out_of_range_ids_are_rejected(qwen):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        qwen.decode([1, qwen.n_vocab])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        qwen.id_to_piece(-1)


def test_incremental_decoder_holds_back_partial_characters(qwen, byte_id):
    # "毕" is e6 af 95: fed one byte token at a time, nothing comes out until the character is complete.
    dec = IncrementalDecoder(qwen)
    assert [dec.push(byte_id[b]) for b in "毕".encode()] == ["", "", "毕"]
    assert dec.push(byte_id[0xF0]) == "" and dec.flush() == "\ufffd"   # dangling lead byte at the end
    assert dec.push(9419) == "Hello"                                           # reusable after flush


def test_incremental_decoder_equals_whole_decode(qwen, byte_id):
    rng = random.Random(3)
    text = "Emoji 👩‍💻🇫🇷 and 漢字かな, ü\u0301, <think>x</think>\n" * 3
    byte_ids = [byte_id[b] for b in range(256)]
    for trial in range(200):
        ids = qwen.encode(text)
        # Splice in raw byte tokens (including stray continuation/lead bytes) and control tokens.
        for _ in range(rng.randint(0, 6)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(byte_ids + [IM_END, 248100]))
        for skip in (False, True):
            dec = IncrementalDecoder(qwen, skip_special=skip)
            pieces = [dec.push(i) for i in ids]
            assert "".join(pieces) + dec.flush() == qwen.decode(ids, skip_special=skip)
    clean = IncrementalDecoder(qwen)
    assert all("\ufffd" not in clean.push(i) for i in qwen.encode(text))


def test_vocabulary_less_and_unsupported_models():
    assert Tokenizer.from_gguf_kv({"tokenizer.ggml.model": "none"}) is None
    assert Tokenizer.from_gguf_kv({"tokenizer.ggml.model": "no_vocab"}) is None
    with pytest.raises(ValueError, match="supported: model 'gpt2'.*'qwen2' or 'qwen35'"):
        Tokenizer.from_gguf_kv({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="pre-tokenizer 'smollm'"):
        Tokenizer.from_gguf_kv({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm"})
    with pytest.raises(ValueError, match="no tokenizer.ggml.model"):
        Tokenizer.from_gguf_kv({})


def _tiny_kv(**changes) -> dict:
    """A hand-made byte-level vocabulary: control tokens first (ids 0-1, as some GGUFs have them), the 256 bytes,
    then merged tokens; "Ġ" is the GPT-2 form of a space."""
    tokens = ["<|endoftext|>", "<|im_end|>"] + [bytes_to_gpt2_string(bytes([b])) for b in range(256)]
    tokens += ["he", "ll", "hell", "hello", "Ġw", "Ġwo", "<think>"]
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [3, 3] + [1] * 262 + [4],
          "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o"],
          "tokenizer.ggml.eos_token_id": 1}
    kv.update(changes)
    return kv


def test_hand_made_vocabulary():
    tok = Tokenizer.from_gguf_kv(_tiny_kv())
    base = 2  # byte b has id base + b
    assert tok.encode("hello world") == [261, 263, base + ord("r"), base + ord("l"), base + ord("d")]
    assert tok.encode("<think>hell<|im_end|>") == [264, 260, 1]
    assert tok.encode("<|im_end|>", parse_special=False)[0] == base + ord("<")
    assert tok.decode(tok.encode("hello <think> wörld")) == "hello <think> wörld"
    assert tok.eos_ids == {0, 1} and tok.special_ids == {0, 1} and tok.added_ids == {0, 1, 264}


def test_bad_metadata_is_reported():
    with pytest.raises(ValueError, match="has no tokenizer.ggml.merges"):
        Tokenizer.from_gguf_kv(_tiny_kv(**{"tokenizer.ggml.merges": None}))
    with pytest.raises(ValueError, match="token_type has 3 entries"):
        Tokenizer.from_gguf_kv(_tiny_kv(**{"tokenizer.ggml.token_type": [1, 1, 1]}))
    with pytest.raises(ValueError, match="inconsistent vocabulary/merges"):
        Tokenizer.from_gguf_kv(_tiny_kv(**{"tokenizer.ggml.merges": ["x yz"]}))
    with pytest.raises(ValueError, match="malformed merge"):
        Tokenizer.from_gguf_kv(_tiny_kv(**{"tokenizer.ggml.merges": ["he"]}))
    with pytest.raises(ValueError, match="eos_token_id 999"):
        Tokenizer.from_gguf_kv(_tiny_kv(**{"tokenizer.ggml.eos_token_id": 999}))
