"""Tool formats: the tool list in the system prompt, a function-call turn, an observation turn,
and parsing calls back out of a model reply (round trip), for default, llama3, qwen, mistral
and glm4.

The llama3 / qwen / mistral templates belong to another module; the tests here render through
probe templates built with those families' LLaMA-Factory slots, so they test the tool formats
alone. Qwen's and Llama 3.1's official Jinja templates (shipped with trl) are the reference for
the text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from registries.templates import FunctionCall, get_template
from registries.templates.formatters import FunctionFormatter, StringFormatter, ToolFormatter
from registries.templates.slots import BOS, EOS
from registries.templates.template import Template
from registries.templates.tools import (
    LLAMA3_TOOL_DATE,
    TOOL_FORMATS,
    get_tool_format,
    llama3_tool_format,
    parse_function_message,
    parse_tools,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_template_families import TRL_TEMPLATES, make_tokenizer  # noqa: E402

WEATHER = {
    "name": "get_weather",
    "description": "Get the weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "description": "Unit", "enum": ["c", "f"]},
        },
        "required": ["city"],
    },
}
TOOLS = json.dumps([WEATHER])
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TWO_CALLS = (
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Nice"}}]'
)
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "function", "content": CALL},
    {"role": "observation", "content": '{"temp": 20}'},
    {"role": "assistant", "content": "20 degrees."},
]
WRAPPED = {"type": "function", "function": WEATHER}


def probe(tool_format: str, **slots) -> Template:
    """An unregistered template with one family's slots, to render a tool format through."""
    assistant = tuple(slots["assistant"])
    return Template(
        name=f"probe-{tool_format}",
        format_user=StringFormatter(tuple(slots["user"])),
        format_assistant=StringFormatter(assistant),
        format_system=StringFormatter(tuple(slots["system"])),
        format_function=FunctionFormatter(tuple(slots.get("function", assistant)), tool_format),
        format_observation=StringFormatter(tuple(slots["observation"])),
        format_tools=ToolFormatter(tool_format),
        format_prefix=tuple(slots.get("prefix", ())),
        default_system=slots.get("default_system", ""),
        system_in_first_user=slots.get("system_in_first_user", False),
    )


LLAMA3 = probe(
    "llama3",
    prefix=[BOS],
    user=[
        "<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ],
    assistant=["{{content}}<|eot_id|>"],
    system=["<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>"],
    observation=[
        "<|start_header_id|>ipython<|end_header_id|>\n\n{{content}}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ],
)
QWEN = probe(
    "qwen",
    user=["<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"],
    assistant=["{{content}}<|im_end|>\n"],
    system=["<|im_start|>system\n{{content}}<|im_end|>\n"],
    observation=["<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"],
    default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
)
MISTRAL = probe(
    "mistral",
    prefix=[BOS],
    user=["[INST] {{content}}[/INST]"],
    assistant=[" {{content}}", EOS],
    system=["{{content}}\n\n"],
    function=["[TOOL_CALLS] {{content}}", EOS],
    observation=['[TOOL_RESULTS] {"content": {{content}}}[/TOOL_RESULTS]'],
    system_in_first_user=True,
)

LLAMA3_TOK = make_tokenizer("<|begin_of_text|>", "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>"))
QWEN_TOK = make_tokenizer(None, "<|im_end|>", ("<|im_start|>",))
MISTRAL_TOK = make_tokenizer("<s>", "</s>", ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"))


# --------------------------------------------------------------------------- tool lists
DEFAULT_TOOL_TEXT = (
    "You have access to the following tools:\n"
    "> Tool Name: get_weather\nTool Description: Get the weather for a city.\nTool Args:\n"
    "  - city (string, required): City name\n"
    "  - unit (string): Unit, should be one of [c, f]\n\n"
    "Use the following format if using a tool:\n```\n"
    "Action: tool name (one of [get_weather])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    '(e.g. ```{"input": "hello world", "num_beams": 5}```)\n```\n'
)
LLAMA3_TOOL_TEXT = (
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function "
    'call. Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    'value}. Do not use variables.\n\n' + json.dumps(WRAPPED, indent=4) + "\n\n"
)
QWEN_TOOL_TEXT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WRAPPED)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
MISTRAL_TOOL_TEXT = "[AVAILABLE_TOOLS] " + json.dumps([WRAPPED]) + "[/AVAILABLE_TOOLS]"
GLM4_TOOL_TEXT = (
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具"
    "\n\n## get_weather\n\n"
    + json.dumps(WEATHER, indent=4, ensure_ascii=False)
    + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
)

TOOL_TEXTS = {
    "default": DEFAULT_TOOL_TEXT,
    "llama3": LLAMA3_TOOL_TEXT,
    "qwen": QWEN_TOOL_TEXT,
    "mistral": MISTRAL_TOOL_TEXT,
    "glm4": GLM4_TOOL_TEXT,
}


def test_the_five_formats_are_registered():
    assert {"default", "llama3", "qwen", "mistral", "glm4"} <= set(TOOL_FORMATS)


def test_duplicate_tool_format_is_rejected():
    from registries.templates.tools import register_tool_format

    with pytest.raises(ValueError, match="Tool format 'qwen' is already registered"):
        register_tool_format(get_tool_format("qwen"))


@pytest.mark.parametrize("name", sorted(TOOL_TEXTS))
def test_tool_list_text_is_exact(name):
    assert ToolFormatter(name).apply(TOOLS) == TOOL_TEXTS[name]
    # OpenAI-wrapped schemas give the same text as bare ones
    assert ToolFormatter(name).apply(json.dumps([WRAPPED])) == TOOL_TEXTS[name]


def test_llama3_date_is_fixed_and_can_be_chosen():
    assert LLAMA3_TOOL_DATE == "26 Jul 2024"  # the default date_string of Meta's Llama 3.1 template
    other = llama3_tool_format("llama3-probe", date="01 Jan 2030")
    assert other.format_tools([WEATHER]) == LLAMA3_TOOL_TEXT.replace("26 Jul 2024", "01 Jan 2030")
    assert "llama3-probe" not in TOOL_FORMATS  # a variant is registered only when the caller does


# --------------------------------------------------------------------------- calls
CALL_TEXTS = {
    "default": 'Action: get_weather\nAction Input: {"city": "Paris"}',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "glm4": 'get_weather\n{"city": "Paris"}',
}
TWO_CALL_TEXTS = {
    "default": 'Action: get_weather\nAction Input: {"city": "Paris"}\nAction: get_weather\nAction Input: {"city": "Nice"}',
    "llama3": '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_weather", "parameters": {"city": "Nice"}}]',
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_weather", "arguments": {"city": "Nice"}}]',
}
PARIS = [FunctionCall("get_weather", '{"city": "Paris"}')]
PARIS_NICE = PARIS + [FunctionCall("get_weather", '{"city": "Nice"}')]


@pytest.mark.parametrize("name", sorted(CALL_TEXTS))
def test_call_text_is_exact_and_round_trips(name):
    fmt = get_tool_format(name)
    assert fmt.format_calls(parse_function_message(CALL)) == CALL_TEXTS[name]
    assert fmt.extract_calls(CALL_TEXTS[name]) == PARIS


@pytest.mark.parametrize("name", sorted(TWO_CALL_TEXTS))
def test_parallel_calls_are_exact_and_round_trip(name):
    fmt = get_tool_format(name)
    assert fmt.format_calls(parse_function_message(TWO_CALLS)) == TWO_CALL_TEXTS[name]
    assert fmt.extract_calls(TWO_CALL_TEXTS[name]) == PARIS_NICE


def test_glm4_rejects_parallel_calls_with_a_clear_error():
    with pytest.raises(ValueError, match=r"exactly one function call per assistant turn, got 2 \(get_weather, get_weather\)"):
        get_tool_format("glm4").format_calls(parse_function_message(TWO_CALLS))


@pytest.mark.parametrize("name", sorted(CALL_TEXTS))
@pytest.mark.parametrize("reply", ["It is sunny in Paris.", "", '{"city": "Paris"}', "<tool_call>\nnot json\n</tool_call>"])
def test_a_reply_that_is_not_a_call_comes_back_as_text(name, reply):
    assert get_tool_format(name).extract_calls(reply) == reply


@pytest.mark.parametrize(
    ("name", "reply"),
    [
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        ("llama3", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
        ("qwen", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
        ("glm4", '\nget_weather\n{"city": "Paris"}\n'),
    ],
)
def test_extraction_tolerates_what_models_emit_around_calls(name, reply):
    assert get_tool_format(name).extract_calls(reply) == PARIS


def test_non_ascii_arguments_survive_the_round_trip():
    call = '{"name": "get_weather", "arguments": {"city": "北京"}}'
    for name in CALL_TEXTS:
        fmt = get_tool_format(name)
        text = fmt.format_calls(parse_function_message(call))
        assert "北京" in text
        assert fmt.extract_calls(text) == [FunctionCall("get_weather", '{"city": "北京"}')]


# --------------------------------------------------------------------------- through templates
def test_default_format_through_granite4():
    tok = make_tokenizer(None, "<|end_of_text|>", ("<|start_of_role|>", "<|end_of_role|>"))
    rendered = get_template("granite4").render(tok, MESSAGES, "Be brief.", TOOLS)
    assert rendered == (
        "<|start_of_role|>system<|end_of_role|>Be brief." + DEFAULT_TOOL_TEXT + "<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Weather in Paris?<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
        'Action: get_weather\nAction Input: {"city": "Paris"}<|end_of_text|>\n'
        '<|start_of_role|>tool<|end_of_role|>{"temp": 20}<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>'
        "20 degrees.<|end_of_text|>\n"
    )


def test_glm4_format_through_glm4():
    tok = make_tokenizer(None, "<|endoftext|>", ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"))
    template = get_template("glm4")
    rendered = template.render(tok, MESSAGES, None, TOOLS)
    assert rendered == (
        "[gMASK]<sop><|system|>\n" + GLM4_TOOL_TEXT + "<|user|>\nWeather in Paris?<|assistant|>"
        'get_weather\n{"city": "Paris"}<|observation|>\n{"temp": 20}<|assistant|>\n20 degrees.'
    )
    assert template.extract_tool_calls('get_weather\n{"city": "Paris"}') == PARIS
    pairs = template.encode_multiturn(tok, MESSAGES, None, TOOLS)
    ids = [i for p, r in pairs for i in p + r]
    assert tok.decode(ids, skip_special_tokens=False) == rendered


def test_llama3_format_through_llama3_slots():
    rendered = LLAMA3.render(LLAMA3_TOK, MESSAGES, "Be brief.", TOOLS)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief." + LLAMA3_TOOL_TEXT + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 20}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n20 degrees.<|eot_id|>"
    )


def test_qwen_format_through_qwen_slots():
    rendered = QWEN.render(QWEN_TOK, MESSAGES, "Be brief.", TOOLS)
    assert rendered == (
        "<|im_start|>system\nBe brief." + QWEN_TOOL_TEXT + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
        "20 degrees.<|im_end|>\n"
    )


def test_mistral_format_through_mistral_slots():
    rendered = MISTRAL.render(MISTRAL_TOK, MESSAGES, None, TOOLS)
    assert rendered == (
        "<s>[INST] " + MISTRAL_TOOL_TEXT + "\n\nWeather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>'
        '[TOOL_RESULTS] {"content": {"temp": 20}}[/TOOL_RESULTS] 20 degrees.</s>'
    )


def test_function_turn_keeps_a_thought_in_front_of_the_calls():
    formatter = FunctionFormatter(("{{content}}<|im_end|>\n",), "qwen")
    slots = formatter.apply("<think>\nLook it up.\n</think>\n\n" + CALL, thought_words=("<think>\n", "\n</think>\n\n"))
    assert slots == [
        "<think>\nLook it up.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    ]


# --------------------------------------------------------------------------- against the official templates
def _official_tool_messages(system):
    messages = [{"role": "system", "content": system}] if system else []
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return messages + [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "20 degrees."},
    ]


@pytest.mark.parametrize("system", [None, "Be brief."], ids=["default-system", "system"])
def test_qwen_matches_the_official_qwen25_template(system):
    official = QWEN_TOK.apply_chat_template(
        _official_tool_messages(system),
        tools=[WRAPPED],
        chat_template=(TRL_TEMPLATES / "qwen2_5.jinja").read_text(),
        tokenize=False,
    )
    assert official == QWEN.render(QWEN_TOK, MESSAGES, system, TOOLS)


def test_llama3_differs_from_the_official_llama31_template_only_as_documented():
    """Meta's template (tools in the system prompt) adds "Environment: ipython", joins its
    sentences without spaces, and JSON-quotes a tool result that is a string; our tool text
    follows LLaMA-Factory's (and Meta's prose docs') wording, and the result goes in verbatim."""
    official = LLAMA3_TOK.apply_chat_template(
        _official_tool_messages(None),
        tools=[WRAPPED],
        chat_template=(TRL_TEMPLATES / "llama3_1.jinja").read_text(),
        tokenize=False,
        tools_in_user_message=False,
    )
    ours = LLAMA3.render(LLAMA3_TOK, MESSAGES, None, TOOLS)
    expected = (
        ours.replace("\n\nCutting Knowledge", "\n\nEnvironment: ipython\nCutting Knowledge")
        .replace("call. Respond", "call.Respond")
        .replace("value}. Do not", "value}.Do not")
        .replace('\n\n{"temp": 20}<|eot_id|>', '\n\n"{\\"temp\\": 20}"<|eot_id|>')
    )
    assert official == expected


# --------------------------------------------------------------------------- user mistakes
@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ("not json", r"Tools must be a JSON list of function schemas, got 'not json'"),
        ("42", r"Tools must be a JSON list of function schemas, got '42'"),
        ('[{"description": "no name"}]', r"Tool 0 has no 'name'"),
        ('[{"type": "function", "function": {"parameters": {}}}]', r"Tool 0 has no 'name'"),
    ],
)
def test_bad_tools_column_is_a_clear_error(tools, message):
    with pytest.raises(ValueError, match=message):
        parse_tools(tools)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("get_weather(city='Paris')", r"A function-call turn must be JSON like"),
        ('{"name": "get_weather"}', r"Each function call needs 'name' and 'arguments' keys"),
    ],
)
def test_bad_function_turn_is_a_clear_error(content, message):
    with pytest.raises(ValueError, match=message):
        get_tool_format("qwen").format_calls(parse_function_message(content))


# --------------------------------------------------------------------------- the registered families
@pytest.mark.parametrize(
    ("name", "probe_template", "tok"),
    [("llama3", LLAMA3, LLAMA3_TOK), ("qwen", QWEN, QWEN_TOK), ("mistral", MISTRAL, MISTRAL_TOK)],
    ids=["llama3", "qwen", "mistral"],
)
@pytest.mark.parametrize("system", [None, "Be brief."], ids=["no-system", "system"])
def test_registered_family_renders_tools_like_its_probe(name, probe_template, tok, system):
    """The registered llama3 / qwen / mistral templates use these tool formats exactly as the probes above do."""
    template = get_template(name)
    assert template.format_tools.tool_format == template.format_function.tool_format == name
    assert template.render(tok, MESSAGES, system, TOOLS) == probe_template.render(tok, MESSAGES, system, TOOLS)
