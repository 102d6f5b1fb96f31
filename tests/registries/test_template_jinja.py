"""The exported Jinja chat template renders exactly what Template.render renders, for every
registered family (including ones added later: the list comes from list_templates())."""

from __future__ import annotations

import dataclasses
import json

import pytest

from registries.templates import get_template, list_templates
from registries.templates.jinja import to_jinja



def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def function(*calls: dict) -> dict:
    return {"role": "function", "content": json.dumps(calls[0] if len(calls) == 1 else list(calls), ensure_ascii=False)}


def observation(content: str) -> dict:
    return {"role": "observation", "content": content}


# name -> (messages, system, add_generation_prompt)
CONVERSATIONS = {
    "basic": ([user("Hi"), assistant("Hello!")], None, False),
    "system_and_odd_text": (
        [user("Hi 'there' \\ {{ x }} {% y %}"), assistant("Hello!\n"), user("你好😀\t"), assistant("Café")],
        'Be "brief", it\'s\tfine \\n',
        False,
    ),
    "empty_system_means_default": ([user("Hi"), assistant("Hello!")], "", False),
    "generation_prompt": ([user("Hi"), assistant("Hello!"), user("Again?")], None, True),
    "tool_call": (
        [
            user("Weather in Paris?"),
            function({"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}),
            observation('{"temp": 21}'),
            assistant("It is 21."),
        ],
        None,
        False,
    ),
    "parallel_tool_calls": (
        [
            user("Both?"),
            function({"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "é"}}),
            observation("ok"),
            assistant("Done."),
        ],
        None,
        False,
    ),
    "thoughts": (
        [user("Q1"), assistant("<think>\nr1\n</think>\n\nA1"), user("Q2"), assistant("<think>\nr2\n</think>\n\nA2")],
        None,
        False,
    ),
}


def to_hf(messages: list[dict], system: str | None) -> list[dict]:
    """Our message schema -> the Hugging Face one (tool calls on assistant messages, tool results)."""
    out = [{"role": "system", "content": system}] if system is not None else []
    for m in messages:
        if m["role"] == "function":
            calls = json.loads(m["content"])
            calls = calls if isinstance(calls, list) else [calls]
            tool_calls = [{"type": "function", "function": c} for c in calls]
            out.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
        elif m["role"] == "observation":
            out.append({"role": "tool", "content": m["content"]})
        else:
            out.append(dict(m))
    return out


def outcome(fn):
    """The rendered text, or the fact that rendering refused (both sides must agree on that)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return "<raised>"


def variants():
    for name in list_templates():
        yield name, False
        if get_template(name).thought_words:
            yield name, True  # the same template with thinking switched off


@pytest.mark.parametrize(("name", "thinking_off"), list(variants()))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_exported_template_renders_like_the_template(tiny_tokenizer, name, thinking_off, conversation):
    template = get_template(name)
    kwargs = {}
    if thinking_off:
        template = dataclasses.replace(template, enable_thinking=False)
        kwargs["enable_thinking"] = False
    messages, system, generation = CONVERSATIONS[conversation]
    jinja = to_jinja(template, tiny_tokenizer)

    ours = outcome(lambda: template.render(tiny_tokenizer, messages, system))
    exported = outcome(
        lambda: tiny_tokenizer.apply_chat_template(
            to_hf(messages, system), chat_template=jinja, tokenize=False, add_generation_prompt=generation, **kwargs
        )
    )
    assert exported == ours
    if conversation in ("basic", "generation_prompt"):
        assert ours != "<raised>"  # every family renders plain chats


REASONING = [name for name in list_templates() if get_template(name).thought_words]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", REASONING)
def test_thought_in_front_of_a_tool_call_is_exported(tiny_tokenizer, name, thinking):
    template = dataclasses.replace(get_template(name), enable_thinking=thinking)
    start, end = template.thought_words
    thought = start + "plan" + end
    call = {"name": "f", "arguments": {"q": 1}}
    ours = [user("Q"), {"role": "function", "content": thought + json.dumps(call)}, observation("r"), assistant("A")]
    hf = [
        user("Q"),
        {"role": "assistant", "content": thought, "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "r"},
        assistant("A"),
    ]
    jinja = to_jinja(template, tiny_tokenizer)
    exported = tiny_tokenizer.apply_chat_template(hf, chat_template=jinja, tokenize=False, enable_thinking=thinking)
    rendered = template.render(tiny_tokenizer, ours)
    assert exported == rendered
    assert ("plan" in rendered) is thinking  # the chain's own thought stays unless thinking is off


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", REASONING)
def test_thoughts_in_replies_are_exported(tiny_tokenizer, name, thinking):
    """History thoughts dropped, the last kept (thinking on) or dropped (off), in each reasoning
    family's own thought words."""
    template = dataclasses.replace(get_template(name), enable_thinking=thinking)
    start, end = template.thought_words
    chat = [user("Q1"), assistant(start + "r1" + end + "A1"), user("Q2"), assistant(start + "r2" + end + "A2")]
    jinja = to_jinja(template, tiny_tokenizer)
    exported = tiny_tokenizer.apply_chat_template(chat, chat_template=jinja, tokenize=False, enable_thinking=thinking)
    rendered = template.render(tiny_tokenizer, chat)
    assert exported == rendered
    assert "r1" not in rendered and ("r2" in rendered) is thinking


def test_rendering_is_not_vacuous(tiny_tokenizer):
    """A spot check of one export's text, so a broken comparison cannot pass unnoticed."""
    jinja = to_jinja(get_template("llama2"), tiny_tokenizer)
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, user("Hi"), assistant("Yo")], chat_template=jinja, tokenize=False
    )
    assert text == "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST]Yo</s>"


def test_thinking_switch_defaults_to_the_template_and_follows_enable_thinking(tiny_tokenizer):
    jinja = to_jinja(get_template("qwen3"), tiny_tokenizer)
    prompt = [user("Hi")]
    on = tiny_tokenizer.apply_chat_template(prompt, chat_template=jinja, tokenize=False, add_generation_prompt=True)
    off = tiny_tokenizer.apply_chat_template(
        prompt, chat_template=jinja, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    history = [user("Q1"), assistant("<think>\nr1\n</think>\n\nA1"), user("Q2"), assistant("A2")]
    full = tiny_tokenizer.apply_chat_template(history, chat_template=jinja, tokenize=False)
    assert full.endswith("<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n")


def test_special_characters_in_default_system_survive_export(tiny_tokenizer):
    odd = "It's a \\ \"test\"\n\t{{ x }} {% y %} 😀"
    template = dataclasses.replace(get_template("chatml"), default_system=odd)
    jinja = to_jinja(template, tiny_tokenizer)
    text = tiny_tokenizer.apply_chat_template([user("Hi"), assistant("Yo")], chat_template=jinja, tokenize=False)
    assert text == template.render(tiny_tokenizer, [user("Hi"), assistant("Yo")])
    assert text.startswith("<|im_start|>system\n" + odd + "<|im_end|>\n")


def test_tool_list_is_refused_with_a_clear_message(tiny_tokenizer):
    jinja = to_jinja(get_template("qwen"), tiny_tokenizer)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(Exception, match="cannot render a tool list"):
        tiny_tokenizer.apply_chat_template([user("Hi")], tools=tools, chat_template=jinja, tokenize=False)


def test_unknown_role_is_refused(tiny_tokenizer):
    jinja = to_jinja(get_template("chatml"), tiny_tokenizer)
    with pytest.raises(Exception, match="Unsupported role critic"):
        tiny_tokenizer.apply_chat_template([user("Hi"), {"role": "critic", "content": "x"}], chat_template=jinja, tokenize=False)


def test_exported_template_survives_save_and_reload(tiny_tokenizer, tmp_path):
    import copy

    from transformers import AutoTokenizer

    template = get_template("llama3")
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = to_jinja(template, tokenizer)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [user("Hi"), assistant("Hello!")]
    assert reloaded.apply_chat_template(messages, tokenize=False) == template.render(tiny_tokenizer, messages)


# ---------------------------------------------------------------- genuine tokenizers
@pytest.mark.parametrize(
    ("name", "fixture", "official"),
    [
        ("llama3", "llama3_tokenizer", "llama3"),
        ("qwen", "qwen3_tokenizer", "qwen2_5"),
        ("qwen3", "qwen3_tokenizer", "qwen3"),
        ("gemma3", "gemma3_tokenizer", "gemma3"),
    ],
)
def test_exported_template_equals_the_official_one_on_genuine_tokenizers(request, name, fixture, official):
    """What a trained model ships renders, token for token, like the family's own template."""
    from pathlib import Path

    import trl

    tokenizer = request.getfixturevalue(fixture)
    official_jinja = (Path(trl.__file__).parent / "chat_templates" / f"{official}.jinja").read_text()
    exported = to_jinja(get_template(name), tokenizer)
    chats = [
        [{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello!"), user("Bye"), assistant("Ciao.")],
        [user("你好😀"), assistant("Café ✓")],
    ]
    for chat in chats:
        for generation in (False, True):
            hf = chat[:-1] if generation else chat
            ours = tokenizer.apply_chat_template(hf, chat_template=exported, add_generation_prompt=generation)
            theirs = tokenizer.apply_chat_template(hf, chat_template=official_jinja, add_generation_prompt=generation)
            assert ours == theirs
