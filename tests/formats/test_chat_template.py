"""Qwen3.5 chat template: the rendered prompts of reference/serving.md §3.2 exactly, the §3.3 rules, bad input."""
import pytest

from ninfer_numba.formats.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat

TOOL_PROMPT = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{TOOLS}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>{SYSTEM}<|im_end|>\n")

WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "Météo <now> & later",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                       "required": ["city"]}}}
WEATHER_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": "Météo <now> & later", '
                '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}')


def _call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ----- serving.md §3.2, verbatim -----

def test_thinking_on_with_system_and_no_think_passthrough():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi /no_think"}]
    assert render_chat(msgs) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi /no_think<|im_end|>\n"
                                 "<|im_start|>assistant\n<think>\n")


def test_thinking_off():
    assert render_chat([{"role": "user", "content": "Hi"}], enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_history_reasoning_is_dropped():
    msgs = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n2"},
            {"role": "user", "content": "Thanks"}]
    assert render_chat(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n")


def test_tools_tool_call_and_tool_response():
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "need tool",
             "tool_calls": [_call("get_weather", '{"city": "Paris", "days": 2}')]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    expect = (TOOL_PROMPT.format(TOOLS=WEATHER_JSON, SYSTEM="")
              + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
              + "<|im_start|>assistant\n<think>\nneed tool\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
                "<|im_end|>\n"
              + "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
              + "<|im_start|>assistant\n<think>\n")
    assert render_chat(msgs, tools=[WEATHER]) == expect


# ----- serving.md §3.3 rules -----

def test_system_prompt_follows_the_tools_block_and_developer_is_system():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "  Be "}, {"type": "text", "text": "kind. "}]},
            {"role": "user", "content": "Hi"}]
    out = render_chat(msgs, tools=[WEATHER, WEATHER])
    assert out.startswith(TOOL_PROMPT.format(TOOLS=WEATHER_JSON + "\n" + WEATHER_JSON, SYSTEM="\n\nBe kind."))
    assert render_chat(msgs).startswith("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_tool_call_layout_and_argument_values():
    args = {"q": "multi\nline", "n": 3, "flag": True, "none": None, "obj": {"a": [1, "é"]}}
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "Calling.", "tool_calls": [_call("f", args), _call("g", "", "c2")]},
            {"role": "tool", "content": "r1"}, {"role": "tool", "content": [{"type": "text", "text": "r2"}]},
            {"role": "assistant", "content": "done"}]
    out = render_chat(msgs, add_generation_prompt=False)
    assert out == (
        "<|im_start|>user\ngo<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nCalling.\n\n<tool_call>\n<function=f>\n"
        "<parameter=q>\nmulti\nline\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
        "<parameter=flag>\ntrue\n</parameter>\n"
        "<parameter=none>\nnull\n</parameter>\n<parameter=obj>\n{\"a\": [1, \"é\"]}\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\ndone<|im_end|>\n")


def test_reasoning_kept_only_inside_the_current_tool_loop():
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "A", "reasoning_content": "old thought"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "", "reasoning_content": "new thought", "tool_calls": [_call("f", {})]},
            {"role": "tool", "content": "x"},
            # a user turn that is only wrapped tool output does not count as the query
            {"role": "user", "content": "<tool_response>\ny\n</tool_response>"},
            {"role": "assistant", "content": "<think>\ninline thought\n</think>\n\nB"}]
    out = render_chat(msgs, add_generation_prompt=False)
    assert "old thought" not in out and "<|im_start|>assistant\nA<|im_end|>" in out
    assert "<think>\nnew thought\n</think>\n\n<tool_call>" in out
    assert out.endswith("<|im_start|>assistant\n<think>\ninline thought\n</think>\n\nB<|im_end|>\n")
    kept = render_chat(msgs, add_generation_prompt=False, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nold thought\n</think>\n\nA<|im_end|>" in kept


def test_whitespace_is_trimmed_and_content_may_be_null():
    msgs = [{"role": "user", "content": "  padded \n"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "\nx"}]
    assert render_chat(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\npadded<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nx<|im_end|>\n")


# ----- bad input -----

@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
    ([{"content": "x"}], "unknown role None"),
    ([{"role": "system", "content": "x"}], "no user message"),
    ([{"role": "user", "content": "<tool_response>\nr\n</tool_response>"}], "No user query"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "must be the first"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "'image_url'"),
    ([{"role": "user", "content": 5}], "must be a string, null or a list"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [_call("f", "{oops")]}], "not valid JSON"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [_call("f", "[1]")]}], "JSON object"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [_call("", {})]}], "name"),
    ([{"role": "user", "content": "a", "tool_calls": [_call("f", {})]}], "assistant message"),
])
def test_bad_messages_raise_value_error(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(messages)


def test_bad_tools_raise_value_error():
    with pytest.raises(ValueError, match="tools must be a list"):
        render_chat([{"role": "user", "content": "a"}], tools={"type": "function"})


# ----- other templates (the GGUF's own) -----

def test_gguf_template_is_used_with_hf_environment():
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
              "{{ tools | tojson if tools else '' }}{{ bos_token }}")
    out = render_chat([{"role": "developer", "content": "S"}, {"role": "user", "content": "Hi"}], template=chatml,
                      tools=[{"x": "<é&>"}], bos_token="<s>")
    assert out == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                   '[{"x": "<é&>"}]<s>')


def test_template_errors_become_value_errors():
    with pytest.raises(ValueError, match="custom failure"):
        render_chat([{"role": "user", "content": "a"}], template="{{ raise_exception('custom failure') }}")
    with pytest.raises(ValueError, match="invalid chat template"):
        render_chat([{"role": "user", "content": "a"}], template="{% for %}")
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat([{"role": "user", "content": "a"}], template="{{ messages[0].content | items | list }}")


def test_default_template_is_self_contained():
    # It is stored in GGUF files, so it must not depend on anything this module injects besides the
    # HF-standard environment (raise_exception, tojson).
    assert "TOOL_INSTRUCTIONS" not in DEFAULT_CHAT_TEMPLATE and "<IMPORTANT>" in DEFAULT_CHAT_TEMPLATE
