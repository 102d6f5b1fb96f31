"""Token-level parity of our templates with the families' own chat templates, on genuine tokenizers.

The reference is the family's chat template (the copies shipped in trl, or the tokenizer's own)
rendered as text and tokenized whole; for Mistral it is mistral-common's encoder. Our side is
``encode_multiturn`` (every turn's prompt + response, concatenated) and ``encode_oneturn``.
Deliberate deviations (whitespace trimming, tokens merging across the prompt/response boundary,
Mistral's system placement) each have a test of their exact shape.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import trl

from registries.templates import get_template

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
SYSTEM = "You are a helpful assistant."


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

# (template, tokenizer fixture, reference jinja in trl, extra chat-template kwargs, system allowed)
FAMILIES = {
    "llama3": ("llama3", "llama3_tokenizer", "llama3", {}, True),
    "qwen": ("qwen", "qwen3_tokenizer", "qwen2_5", {}, True),
    "qwen3": ("qwen3", "qwen3_tokenizer", "qwen3", {}, True),
    "qwen3-thinking-off": ("qwen3", "qwen3_tokenizer", "qwen3", {"enable_thinking": False}, True),
    "qwen3_nothink": ("qwen3_nothink", "qwen3_tokenizer", "qwen3_instruct_2507", {}, True),
    "gemma": ("gemma", "gemma3_tokenizer", "gemma", {}, False),  # Gemma-1/2's template rejects a system
    "gemma2": ("gemma2", "gemma3_tokenizer", "gemma", {}, False),
    "gemma3": ("gemma3", "gemma3_tokenizer", "gemma3", {}, True),
}


def official_text(tokenizer, jinja: str, messages, system=None, **kwargs) -> str:
    hf = ([{"role": "system", "content": system}] if system else []) + messages
    template = (TRL_TEMPLATES / f"{jinja}.jinja").read_text()
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
TRIMMING = {"llama3", "gemma", "gemma2", "gemma3"}


def family_params():
    for family, (name, _, _, _, with_system) in FAMILIES.items():
        conversations = list(CONVERSATIONS) + ([] if name in TRIMMING else ["whitespace_around"])
        for conversation in conversations:
            yield pytest.param(family, conversation, None, id=f"{family}-{conversation}")
            if with_system:
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
    assert template.render(tokenizer, messages, system) == tokenizer.decode(expected)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_prompt_ends_where_the_official_generation_prompt_ends(request, family):
    """Label masks are exact: the prompt of turn t ends exactly at the official generation
    prompt for the conversation so far, so the response ids are the reply and nothing else."""
    name, fixture, jinja, kwargs, _ = FAMILIES[family]
    tokenizer = request.getfixturevalue(fixture)
    template = family_template(name, kwargs)
    messages = CONVERSATIONS["multi"]
    pairs = template.encode_multiturn(tokenizer, messages)
    history: list[int] = []
    for turn, (prompt, response) in enumerate(pairs):
        is_last = turn == len(pairs) - 1
        # Qwen3 with thinking off writes the empty thought only into the generation prompt of
        # the reply being generated; a history reply carries none, so only the last turn compares.
        if is_last or kwargs.get("enable_thinking") is not False:
            so_far = messages[: 2 * turn + 1]
            generation_prompt = official_ids(tokenizer, jinja, so_far, add_generation_prompt=True, **kwargs)
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
    [("llama3", "llama3_tokenizer", "llama3"), ("gemma3", "gemma3_tokenizer", "gemma3"), ("gemma", "gemma3_tokenizer", "gemma")],
)
def test_trimming_templates_keep_surrounding_whitespace(request, name, fixture, jinja):
    """Llama-3 and Gemma trim every message; we keep content as written (LLaMA-Factory does the
    same), so the only difference is the trimmed whitespace: stripped data matches exactly."""
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
