"""Constrained decoding (engine/constraint.py) at the real Qwen3.5 vocabulary.

Random walks draw a uniformly random allowed token at every step: whatever path they take must end in text that
the server reads back as a valid response (JSON valid against the schema, or a tool call whose arguments are
valid against the tool's parameters). Bounded grammars only, so that a walk ends.
"""
from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import pytest

from ninfer_numba.engine.constraint import json_constraint, tool_call_constraint
from ninfer_numba.formats.tokenizer import Tokenizer
from ninfer_numba.model.weights import open_model
from ninfer_numba.server.output_parser import ChatOutputParser, ToolCallArgs, ToolCallStart

WALKS = 100
MAX_STEPS = 400

BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["unit", "ok", "n"],
    "additionalProperties": False,
}
TOOLS = {
    "get_weather": {"name": "get_weather", "description": "Forecast for a city.", "parameters": {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "days"]}},
    "set_alarm": {"name": "set_alarm", "parameters": {
        "type": "object",
        "properties": {"loud": {"type": "boolean"},
                       "repeat": {"type": "object", "properties": {"weekly": {"enum": [0, 1]}},
                                  "required": ["weekly"], "additionalProperties": False}}}},
}
CALL_TEXT = re.compile(r"(?:<function=(\w+)>\n)?((?:<parameter=\w+>\n.*?\n</parameter>\n)*)</function>\n</tool_call>",
                       re.S)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_gguf_kv(open_model(tiny_model, log=lambda *a, **k: None).file.kv)


@pytest.fixture(scope="module")
def ids(tokenizer):
    im_end, endoftext = tokenizer.token_id("<|im_end|>"), tokenizer.token_id("<|endoftext|>")
    return {"im_end": im_end, "endoftext": endoftext, "call_close": tokenizer.token_id("</tool_call>"),
            # added tokens a grammar never names: allowing one would put e.g. <think> inside the JSON text
            "unnamed_added": np.array(sorted(tokenizer.added_ids - {im_end, endoftext,
                                                                    tokenizer.token_id("</tool_call>")}))}


def random_walk(constraint, rng, stop_ids, never_allowed, timings=None) -> list[int]:
    """Token ids drawn uniformly from allowed() until a stop token (not included in the result)."""
    tokens = []
    for _ in range(MAX_STEPS):
        t0 = time.perf_counter()
        mask = constraint.allowed()
        if timings is not None:
            timings.append(time.perf_counter() - t0)
        assert not mask[never_allowed].any()
        allowed = np.flatnonzero(mask)
        assert allowed.size, f"nothing allowed after {tokens}"
        token = int(rng.choice(allowed))
        constraint.advance(token)
        if token in stop_ids:
            assert constraint.done
            return tokens
        tokens.append(token)
    pytest.fail(f"random walk did not reach a stop token in {MAX_STEPS} steps: {tokens[:40]}...")


def parse_call(text: str, forced: str | None) -> tuple[str, dict]:
    """(name, arguments) as the server's output parser reads the text after the prompt's call opening."""
    parser = ChatOutputParser(start_in_reasoning=False, tools=TOOLS, start_in_call=True, forced_function=forced)
    events = parser.feed(text) + parser.finish()
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert len(starts) == 1, events
    return starts[0].name, json.loads("".join(e.fragment for e in events if isinstance(e, ToolCallArgs)))


def test_json_schema_random_walks(tokenizer, ids):
    rng = np.random.default_rng(0)
    stop_ids = tokenizer.eos_ids
    never = np.concatenate([ids["unnamed_added"], [ids["call_close"]]])
    for _ in range(WALKS):
        tokens = random_walk(json_constraint(tokenizer, BOUNDED_SCHEMA, stop_ids), rng, stop_ids, never)
        text = tokenizer.decode(tokens)
        value = json.loads(text)
        jsonschema.validate(value, BOUNDED_SCHEMA)
        assert text == json.dumps(value)       # json.dumps's layout, no other whitespace


def test_json_object_any(tokenizer, ids):
    rng = np.random.default_rng(1)
    stop_ids = {ids["im_end"]}
    never = np.concatenate([ids["unnamed_added"], [ids["endoftext"]]])
    constraint = json_constraint(tokenizer, None, stop_ids)
    for _ in range(50):
        mask = constraint.allowed()
        assert mask.any() and not mask[never].any()
        token = int(rng.choice(np.flatnonzero(mask)))
        constraint.advance(token)
        if token in stop_ids:      # the object was closed: start another
            assert constraint.done
            constraint = json_constraint(tokenizer, None, stop_ids)

    constraint = json_constraint(tokenizer, None, [ids["im_end"]])
    for token in tokenizer.encode('{"a": 1, "b": [true, null, "x"]}'):
        assert not constraint.allowed()[ids["im_end"]]
        constraint.advance(token)
    assert constraint.allowed()[ids["im_end"]]
    constraint.advance(ids["im_end"])
    assert constraint.done

    # Not an object, or not json.dumps's layout: refused at some token.
    for text in ('[1]', '{"a":1}', '{"a": 1} '):
        constraint = json_constraint(tokenizer, None, [ids["im_end"]])
        with pytest.raises(ValueError):
            for token in tokenizer.encode(text) + [ids["im_end"]]:
                constraint.advance(token)


@pytest.mark.parametrize("forced", [None, "get_weather"])
def test_tool_call_random_walks(tokenizer, ids, forced):
    rng = np.random.default_rng(2)
    stop_ids = {ids["im_end"]}
    never = np.concatenate([ids["unnamed_added"], [ids["endoftext"]]])
    names, optional_seen = set(), set()
    for _ in range(WALKS):
        tokens = random_walk(tool_call_constraint(tokenizer, TOOLS, forced, stop_ids), rng, stop_ids, never)
        assert tokens[-1] == ids["call_close"]
        text = tokenizer.decode(tokens)
        match = CALL_TEXT.fullmatch(text)
        assert match and (match.group(1) is None) == (forced is not None), text
        name, arguments = parse_call(text, forced)
        assert name == (forced or match.group(1))
        schema = TOOLS[name]["parameters"]
        jsonschema.validate(arguments, schema)
        assert list(arguments) == [k for k in schema["properties"] if k in arguments]   # declared order
        names.add(name)
        optional_seen |= {(k, k in arguments) for k in schema["properties"] if k not in schema.get("required", ())}
    assert names == ({forced} if forced else set(TOOLS))
    if forced is None:   # optional parameters were both written and left out
        assert optional_seen == {("loud", True), ("loud", False), ("repeat", True), ("repeat", False)}


def test_tool_call_free_text_parameter(tokenizer, ids):
    tools = {"note": {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                                     "required": ["text"]}}}
    value = "see <b>this</b> & 1 < 2\nsecond line"
    body = f"<parameter=text>\n{value}\n</parameter>\n</function>\n"
    constraint = tool_call_constraint(tokenizer, tools, "note", [ids["im_end"]])
    for token in tokenizer.encode(body + "</tool_call>"):
        constraint.advance(token)
    constraint.advance(ids["im_end"])
    assert constraint.done
    assert parse_call(body + "</tool_call>", "note") == ("note", {"text": value})

    # A value may not hold a marker the output parser would end it at; the required parameter may not be left out.
    for text in ("<parameter=text>\nx</function>\n", "<parameter=text>\nx\n<parameter=y>\n", "</function>\n"):
        constraint = tool_call_constraint(tokenizer, tools, "note", [ids["im_end"]])
        with pytest.raises(ValueError):
            for token in tokenizer.encode(text + "</tool_call>") + [ids["im_end"]]:
                constraint.advance(token)


def test_forbidden_token_and_invalid_schemas(tokenizer, ids):
    constraint = json_constraint(tokenizer, BOUNDED_SCHEMA, [ids["im_end"]])
    opening = tokenizer.token_id('{"')    # the bytes '{"unit": "' are forced; llguidance allows their BPE tokens
    for token in (tokenizer.token_id("["), ids["im_end"], ids["endoftext"], tokenizer.token_id("<think>")):
        assert not constraint.allowed()[token]
        with pytest.raises(ValueError):
            constraint.advance(token)
    assert constraint.allowed()[opening]   # a refused token leaves the constraint usable
    constraint.advance(opening)

    for schema in ({"type": "no-such-type"}, {"type": "integer", "minimum": 5, "maximum": 2}, [1]):
        with pytest.raises(ValueError, match=r"^[^\n]+$"):
            json_constraint(tokenizer, schema, [ids["im_end"]])
    bad_tool = {"f": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}}
    with pytest.raises(ValueError, match=r"^[^\n]+$"):
        tool_call_constraint(tokenizer, bad_tool, None, [ids["im_end"]])
    with pytest.raises(ValueError, match="not among"):
        tool_call_constraint(tokenizer, TOOLS, "no_such_function", [ids["im_end"]])


def test_allowed_timing(tokenizer, ids):
    """Mean allowed() time at the 248K vocabulary; printed, and bounded so that a regression shows."""
    rng = np.random.default_rng(3)
    free_text = {"note": {"name": "note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "n": {"type": "integer"}}, "required": ["text", "n"]}}}
    cases = {"json schema": lambda: json_constraint(tokenizer, BOUNDED_SCHEMA, [ids["im_end"]]),
             "json object": lambda: json_constraint(tokenizer, None, [ids["im_end"]]),
             "tool call, free text": lambda: tool_call_constraint(tokenizer, free_text, "note", [ids["im_end"]])}
    for label, make in cases.items():
        timings = []
        for _ in range(5):
            constraint = make()
            for _ in range(40):
                t0 = time.perf_counter()
                mask = constraint.allowed()
                timings.append(time.perf_counter() - t0)
                if constraint.done:
                    break
                mask[ids["im_end"]] = False    # keep going: the walk is for timing, not for ending
                constraint.advance(int(rng.choice(np.flatnonzero(mask))))
        mean_ms, max_ms = 1e3 * float(np.mean(timings)), 1e3 * float(np.max(timings))
        print(f"allowed() {label}: mean {mean_ms:.3f} ms, max {max_ms:.3f} ms over {len(timings)} calls")
        assert mean_ms < 50


def test_bitmask_is_allowed_packed(tokenizer, ids):
    """The device sampler's mask (bitmask) is allowed() packed bit i % 32 of word i // 32, padded with
    forbidden ids past the tokenizer's vocabulary or cut at a smaller n_vocab, along a walk and after the
    stop token."""
    def packed(mask, n):
        bits = np.zeros(-(-n // 32) * 32, bool)
        bits[:min(n, mask.size)] = mask[:n]
        return np.packbits(bits, bitorder="little").view(np.int32)

    rng = np.random.default_rng(3)
    stop = ids["im_end"]
    c = json_constraint(tokenizer, BOUNDED_SCHEMA, {stop})
    V = tokenizer.n_vocab
    for _ in range(MAX_STEPS):
        mask = c.allowed()
        for n in (V, V + 40, V - 5, V - 32):
            np.testing.assert_array_equal(c.bitmask(n), packed(mask, n))
        token = int(rng.choice(np.flatnonzero(mask)))
        c.advance(token)
        if token == stop:
            break
    assert c.done
    np.testing.assert_array_equal(c.bitmask(V + 40), packed(c.allowed(), V + 40))
    assert np.flatnonzero(c.allowed()).tolist() == [stop]
