"""Reasoning / content / tool-call parsing on strings, fed whole and in every split the stream might make."""
from __future__ import annotations

import json

import pytest

from ninfer_numba.server.output_parser import ChatOutputParser, TextDelta, ToolCallArgs, ToolCallStart

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "coords": {"type": "array"}}}}
TOOLS = {"get_weather": WEATHER}


def run(text: str, pieces: int | None = None, **kwargs) -> dict:
    """Feeds `text` whole (pieces=None) or in chunks of `pieces` characters; returns the joined result."""
    kwargs.setdefault("start_in_reasoning", True)
    parser = ChatOutputParser(**kwargs)
    step = pieces or max(len(text), 1)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    out = {"reasoning": "", "content": "", "calls": []}
    for ev in events:
        if isinstance(ev, TextDelta):
            out[ev.channel] += ev.text
        elif isinstance(ev, ToolCallStart):
            assert ev.index == len(out["calls"]) and ev.call_id.startswith("call_")
            out["calls"].append({"name": ev.name, "arguments": ""})
        elif isinstance(ev, ToolCallArgs):
            out["calls"][ev.index]["arguments"] += ev.fragment
    for call in out["calls"]:
        call["arguments"] = json.loads(call["arguments"])   # every call's fragments join into valid JSON
    return out


SPLITS = [None, 1, 2, 3, 7]


@pytest.mark.parametrize("pieces", SPLITS)
def test_reasoning_then_content(pieces):
    out = run("Let me think.\nStep two.\n</think>\n\nThe answer is 4.", pieces)
    assert out == {"reasoning": "Let me think.\nStep two.", "content": "The answer is 4.", "calls": []}


@pytest.mark.parametrize("pieces", SPLITS)
def test_content_only_when_thinking_is_off(pieces):
    out = run("Plain answer\nwith two lines.", pieces, start_in_reasoning=False)
    assert out == {"reasoning": "", "content": "Plain answer\nwith two lines.", "calls": []}


@pytest.mark.parametrize("pieces", SPLITS)
def test_tool_call_with_schema_types(pieces):
    text = ("Need weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=metric>\ntrue\n</parameter>\n<parameter=coords>\n[1.5, 2]\n</parameter>\n"
            "</function>\n</tool_call>")
    out = run(text, pieces, tools=TOOLS)
    assert out["reasoning"] == "Need weather."
    assert out["content"] == "Checking."
    assert out["calls"] == [{"name": "get_weather", "arguments": {
        "city": "San Francisco", "days": 3, "metric": True, "coords": [1.5, 2]}}]


@pytest.mark.parametrize("pieces", SPLITS)
def test_two_calls_multiline_value_and_duplicated_close_tag(pieces):
    text = ("</think>\n\n<tool_call>\n<function=note>\n<parameter=body>\nline 1\nline 2\n</parameter>\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")
    out = run(text, pieces, tools=TOOLS)
    assert out["content"] == "" and out["reasoning"] == ""
    assert out["calls"] == [{"name": "note", "arguments": {"body": "line 1\nline 2"}},
                            {"name": "get_weather", "arguments": {"city": "Oslo"}}]


@pytest.mark.parametrize("pieces", SPLITS)
def test_tool_call_inside_reasoning_ends_reasoning(pieces):
    out = run("I will call it.\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", pieces,
              tools=TOOLS)
    assert out["reasoning"] == "I will call it."
    assert out["calls"] == [{"name": "get_weather", "arguments": {}}]


@pytest.mark.parametrize("pieces", SPLITS)
def test_without_tools_the_markup_is_content(pieces):
    text = "</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    out = run(text, pieces, tools=None)
    assert out["calls"] == [] and out["content"] == "<tool_call>\n<function=f>\n</function>\n</tool_call>"


@pytest.mark.parametrize("pieces", SPLITS)
def test_json_call_format_of_older_models(pieces):
    text = '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    out = run(text, pieces, tools=TOOLS)
    assert out["calls"] == [{"name": "get_weather", "arguments": {"city": "Rome"}}]


@pytest.mark.parametrize("pieces", SPLITS)
def test_garbage_in_call_block_is_kept_as_content(pieces):
    out = run("</think>\n\n<tool_call>\nnot a call\n</tool_call>\nbye", pieces, tools=TOOLS)
    assert out["calls"] == []
    assert out["content"] == "<tool_call>\nnot a call\n</tool_call>bye"


def test_call_cut_by_max_tokens_still_has_valid_arguments():
    out = run("</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n2", tools=TOOLS)
    assert out["calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_forced_function_and_required_start_inside_the_call():
    forced = run("<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>", start_in_reasoning=False,
                 tools=TOOLS, forced_function="get_weather")
    assert forced["calls"] == [{"name": "get_weather", "arguments": {"city": "Lima"}}]
    required = run("<function=get_weather>\n<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>",
                   start_in_reasoning=False, tools=TOOLS, start_in_call=True)
    assert required["calls"] == [{"name": "get_weather", "arguments": {"days": 5}}]


@pytest.mark.parametrize("pieces", SPLITS)
def test_model_opened_think_block_when_prompt_did_not(pieces):
    out = run("<think>\nhmm\n</think>\n\nok", pieces, start_in_reasoning=False)
    assert out == {"reasoning": "hmm", "content": "ok", "calls": []}


def test_truncated_reasoning_and_partial_marker_are_released_at_the_end():
    out = run("still thinking </thi")
    assert out == {"reasoning": "still thinking </thi", "content": "", "calls": []}


def test_unknown_parameter_is_converted_without_schema():
    out = run("</think><tool_call><function=get_weather><parameter=extra>{\"a\": [1]}</parameter>"
              "<parameter=city>\nnull\n</parameter></function></tool_call>", tools=TOOLS)
    assert out["calls"][0]["arguments"] == {"extra": {"a": [1]}, "city": None}
