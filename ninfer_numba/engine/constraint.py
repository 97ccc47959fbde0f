"""Constrained decoding: the set of tokens a grammar allows next, for OpenAI `response_format` and `tool_choice`.

A `TokenConstraint` wraps an llguidance matcher over the model's vocabulary. Before each draw the sampler asks
`allowed()` for a boolean mask over the vocabulary and masks the logits with it; after the draw it calls
`advance(token)`. Two grammars are built here:

- `json_constraint`: one JSON value valid against the request's JSON schema (`json_schema`), or any JSON object
  (`json_object`), then a stop token.
- `tool_call_constraint`: the Qwen3.5/3.6 XML-ish call that follows the `<tool_call>\\n` the prompt ends with
  (reference/serving.md §3.5), so that `tool_choice` "required" or a named function yields a call the server's
  output parser turns into valid arguments.

JSON is constrained to json.dumps's default layout (`", "` and `": "`, no other whitespace): with free
whitespace a model can emit blank space between two tokens forever and still be "valid".
String parameters of a tool call are written verbatim (not as JSON): a string `enum`/`const` allows exactly
those values, any other string any text that does not contain a marker the output parser ends a value at
(`</parameter>`, `</function>`, `</tool_call>`, a newline followed by `<parameter=`). String keywords such as
`pattern` or `maxLength` are not enforced on verbatim values. Every other type is written as JSON and
constrained by its schema. Parameters come in the schema's `properties` order, required ones always, optional
ones possibly not, and no undeclared ones.

The llguidance tokenizer takes about a second to build at Qwen's 248K vocabulary, so one is kept per Tokenizer.
Its end-of-sequence tokens are the vocabulary's end-of-turn ids; each constraint maps its own `stop_ids` onto
them, so that constraints with different stop tokens share it.
"""
from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Iterable

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from ninfer_numba.kernels.sample.ref import mask_allowed

# json.dumps's default separators and no free whitespace (see the module docstring). Passed as llguidance's
# defaults so that a schema's own "x-guidance" options still take precedence.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Short, single-line error messages: they go back to the client as a 400.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

_LLTOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LLTOKENIZERS_LOCK = threading.Lock()

# Text a verbatim string parameter may hold: anything without a marker that ends a value in the output parser
# (server/output_parser.py), so that the parser reads back exactly the value the grammar allowed.
_PARAM_TEXT = (r"PARAM_TEXT: /(?s:.*)/ & "
               r"~/(?s:.*)(<\/parameter>|<\/function>|<\/tool_call>|\n<parameter=)(?s:.*)/")
_PARAM_CLOSE, _FUNCTION_CLOSE = "\n</parameter>\n", "</function>\n"


class _VocabForLLGuidance:
    """The attributes and the encode call that llguidance.TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Any, eos_ids: list[int]):
        self._tokenizer = tokenizer
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None
        added = tokenizer.added_ids
        # Added tokens (<|im_end|>, <tool_call>, <think>...) get llguidance's 0xFF marker: a grammar then never
        # allows them as the text they spell (inside a JSON string, say), only where it names them.
        self.tokens = [b"\xff" + tokenizer.token_bytes(i) if i in added else tokenizer.token_bytes(i)
                       for i in range(tokenizer.n_vocab)]
        self.special_token_ids = sorted(added)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, parse_special=False)


def lltokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of `tokenizer` (built once per Tokenizer object, ~1 s at 248K tokens)."""
    with _LLTOKENIZERS_LOCK:
        cached = _LLTOKENIZERS.get(tokenizer)
        if cached is None:
            eos_ids = sorted(tokenizer.eos_ids)
            if not eos_ids:
                raise ValueError("constrained decoding needs a vocabulary with an end-of-turn token")
            wrapper = llguidance.TokenizerWrapper(_VocabForLLGuidance(tokenizer, eos_ids))
            cached = llguidance.LLTokenizer(wrapper, n_vocab=tokenizer.n_vocab, eos_token=eos_ids)
            _LLTOKENIZERS[tokenizer] = cached
        return cached


def _one_line(message: str) -> str:
    return " ".join(message.split()) or "unknown error"


class TokenConstraint:
    """Allowed next tokens under a grammar, advanced one generated token at a time (an llguidance LLMatcher)."""

    def __init__(self, lltok: llguidance.LLTokenizer, grammar: str, stop_ids: Iterable[int], *,
                 what: str = "invalid grammar"):
        stops = sorted({int(t) for t in stop_ids})
        if not stops:
            raise ValueError("a constraint needs at least one stop token id")
        self._n_vocab = lltok.vocab_size
        if not all(0 <= t < self._n_vocab for t in stops):
            raise ValueError(f"stop token ids {stops} are outside the vocabulary (0..{self._n_vocab - 1})")
        self._matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=_LIMITS)
        self._check(what)
        self._stop_ids = np.array(stops, dtype=np.int64)
        self._stop_set = frozenset(stops)
        self._grammar_eos = np.array(lltok.eos_tokens, dtype=np.int64)
        self._grammar_eos_set = frozenset(lltok.eos_tokens)
        self._eos = lltok.eos_token
        self._bitmask = llg_numpy.allocate_token_bitmask(1, self._n_vocab)
        self._stopped = False   # a stop token was consumed

    def _check(self, what: str) -> None:
        if self._matcher.is_error():
            raise ValueError(f"{what}: {_one_line(self._matcher.get_error())}")

    def _words(self) -> np.ndarray:
        """The allowed set as llguidance packs it (uint32 [ceil(n_vocab / 32)], bit i % 32 of word i // 32), its
        end-of-sequence tokens replaced by this constraint's stop tokens: llguidance marks its own end tokens
        where the grammar may end; a stop token takes their place (and nothing else does: a stop token always
        ends the constrained text). The substitution works on the words, so the device sampler's mask is
        never unpacked and packed again."""
        words = np.zeros(self._bitmask.shape[1], np.uint32)
        if self._stopped:
            np.bitwise_or.at(words, self._stop_ids >> 5, np.uint32(1) << (self._stop_ids & 31).astype(np.uint32))
            return words
        llg_numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        self._check("constraint failed")
        words[:] = self._bitmask[0].view(np.uint32)
        eos = self._grammar_eos
        eos_bits = np.uint32(1) << (eos & 31).astype(np.uint32)
        can_stop = bool((words[eos >> 5] & eos_bits).any())
        np.bitwise_and.at(words, eos >> 5, ~eos_bits)
        if can_stop:
            np.bitwise_or.at(words, self._stop_ids >> 5,
                             np.uint32(1) << (self._stop_ids & 31).astype(np.uint32))
        return words

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar allows next (the stop tokens once the grammar is complete)."""
        return mask_allowed(self._words(), self._n_vocab)

    def bitmask(self, n_vocab: int) -> np.ndarray:
        """allowed() packed for the device sampler: int32 [ceil(n_vocab / 32)], bit i % 32 of word i // 32 set
        where token i is allowed (ids past the tokenizer's vocabulary never are)."""
        words = self._words()
        out = np.zeros(-(-n_vocab // 32), np.uint32)
        k = min(out.size, words.size)
        out[:k] = words[:k]
        last = min(n_vocab, self._n_vocab)                  # bits from here on are not tokenizer ids
        if last % 32 and last // 32 < out.size:
            out[last // 32] &= np.uint32((1 << (last % 32)) - 1)
        return out.view(np.int32)

    def advance(self, token: int) -> None:
        """Consume a generated token; ValueError if the grammar forbids it (the constraint is then unchanged)."""
        token = int(token)
        if token in self._stop_set:
            if self._stopped:
                return
            if not self._matcher.is_accepting():
                raise ValueError(f"stop token {token} before the constrained text is complete")
            self._matcher.consume_token(self._eos)
            self._check("constraint failed")
            self._stopped = True
            return
        if self._stopped:
            raise ValueError(f"token {token} after the stop token")
        if token in self._grammar_eos_set or not 0 <= token < self._n_vocab:
            raise ValueError(f"token {token} is not allowed here")
        # Validate first: a failed consume would leave the matcher in its permanent error state.
        if self._matcher.validate_tokens([token]) != 1:
            raise ValueError(f"token {token} is not allowed by the grammar here")
        self._matcher.consume_token(token)
        self._check("constraint failed")

    @property
    def done(self) -> bool:
        """The grammar has ended: a stop token was consumed, or only a stop token can follow."""
        return self._stopped or self._matcher.is_stopped()


def json_constraint(tokenizer: Any, schema: dict | None, stop_ids: Iterable[int]) -> TokenConstraint:
    """One JSON value valid against `schema` (None: any JSON object), then a stop token."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema must be an object, not {type(schema).__name__}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid JSON schema: {_one_line(str(exc))}") from None
    return TokenConstraint(lltokenizer(tokenizer), grammar, stop_ids, what="invalid JSON schema")


def tool_call_constraint(tokenizer: Any, tools: dict[str, dict], forced: str | None,
                         stop_ids: Iterable[int]) -> TokenConstraint:
    """A Qwen3.5 tool call after the prompt's "<tool_call>\\n" (forced=None: any of `tools`) or after its
    "<tool_call>\\n<function=NAME>\\n" (forced=NAME), through "</tool_call>", then a stop token."""
    if not tools:
        raise ValueError("tool_call_constraint needs at least one tool")
    if forced is not None and forced not in tools:
        raise ValueError(f"tool_choice names function {forced!r}, which is not among the request's tools")
    call_close = tokenizer.token_id("</tool_call>")
    grammar = _tool_call_lark(tools, forced, _lark_string("</tool_call>") if call_close is None
                              else f"<[{call_close}]>")
    return TokenConstraint(lltokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(grammar), stop_ids,
                           what="invalid tool parameters schema")


def _lark_string(text: str) -> str:
    # llguidance reads Lark string literals with JSON escapes.
    return json.dumps(text, ensure_ascii=False)


def _tool_call_lark(tools: dict[str, dict], forced: str | None, call_close: str) -> str:
    names = [forced] if forced is not None else list(tools)
    rules = [_PARAM_TEXT]
    calls = []
    for i, name in enumerate(names):
        tool = tools[name] if isinstance(tools[name], dict) else {}
        body = _parameter_rules(f"f{i}", tool.get("parameters"), rules)
        header = "" if forced is not None else _lark_string(f"<function={name}>\n")
        rules.append(f"f{i}: {header} {body} {_lark_string(_FUNCTION_CLOSE)}")
        calls.append(f"f{i}")
    rules.insert(0, f"start: ({' | '.join(calls)}) {call_close}")
    return "\n".join(rules) + "\n"


def _parameter_rules(prefix: str, parameters: Any, rules: list[str]) -> str:
    """Adds one rule per declared parameter; returns their sequence, optional ones marked `?`."""
    if parameters is None:
        return ""
    if not isinstance(parameters, dict):
        raise ValueError(f"tool parameters must be a JSON schema object, not {type(parameters).__name__}")
    properties = parameters.get("properties") or {}
    if not isinstance(properties, dict):
        raise ValueError("tool parameters' properties must be an object")
    required = set(parameters.get("required") or ())
    # Definitions that $ref may point at travel with each parameter's own schema.
    shared = {k: parameters[k] for k in ("$defs", "definitions") if isinstance(parameters.get(k), dict)}
    sequence = []
    for j, (key, schema) in enumerate(properties.items()):
        rule = f"{prefix}_p{j}"
        opening = _lark_string(f"<parameter={key}>\n")
        enum = _verbatim_enum(schema)
        if enum is not None:
            terminal = rule.upper()
            rules.append(f"{terminal}: ({' | '.join(_lark_string(v) for v in enum)}) {_lark_string(_PARAM_CLOSE)}")
            rules.append(f"{rule}: {opening} {terminal}")
        elif _is_verbatim_text(schema):
            terminal = rule.upper()
            rules.append(f"{terminal}: PARAM_TEXT {_lark_string(_PARAM_CLOSE)}")
            rules.append(f"{rule}: {opening} {terminal}")
        else:
            own_options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
            value_schema = {**shared, **schema, "x-guidance": {**JSON_LAYOUT, **own_options}}
            rules.append(f"{rule}: {opening} %json {json.dumps(value_schema)} {_lark_string(_PARAM_CLOSE)}")
        sequence.append(rule if key in required else rule + "?")
    return " ".join(sequence)


def _verbatim_enum(schema: Any) -> list[str] | None:
    """The allowed values of a string enum (or string const), written verbatim; None for anything else."""
    if not isinstance(schema, dict):
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return None


def _is_verbatim_text(schema: Any) -> bool:
    """Whether a parameter is written as raw text: a string type (alone or in a union) or no type at all.

    Free text is a superset of every such value as the server converts it (tool_args.convert_parameter).
    """
    if not isinstance(schema, dict):
        return True
    types = _declared_types(schema)
    return not types or "string" in types


def _declared_types(schema: dict) -> set[str]:
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else {t for t in declared or () if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or ():
            if isinstance(member, dict):
                types |= _declared_types(member) or {"any"}
    if any(k in schema for k in ("enum", "const", "properties", "items", "$ref", "allOf")):
        types.add("structured")    # a non-string enum, an untyped object/array, a reference: JSON, not raw text
    return types
