"""Template auto-detection from a tokenizer's own chat template, and the loud warning when a
named template renders differently from it."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest

from registries.templates import get_template
from registries.templates.autodetect import TemplateMismatchWarning, auto_template_reason, matching_templates, \
    resolve_template
from registries.templates.jinja import to_jinja


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [("llama3_tokenizer", "llama3"), ("qwen3_tokenizer", "qwen3"), ("gemma3_tokenizer", "gemma3")],
)
@pytest.mark.parametrize("name", [None, "auto"])
def test_auto_picks_the_family_of_a_genuine_tokenizer(request, fixture, expected, name):
    tokenizer = request.getfixturevalue(fixture)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean match warns about nothing
        assert resolve_template(name, tokenizer).name == expected


def test_only_the_exact_family_matches(llama3_tokenizer, qwen3_tokenizer):
    assert matching_templates(llama3_tokenizer) == ["llama3"]
    assert matching_templates(qwen3_tokenizer) == ["qwen3"]  # not qwen (default system), qwen3_nothink, chatml


def test_look_alike_families_are_broken_by_the_model_path(gemma3_tokenizer):
    """gemma, gemma2 and gemma3 render alike; the tokenizer's path names the family."""
    assert matching_templates(gemma3_tokenizer) == ["gemma", "gemma2", "gemma3"]
    tokenizer = copy.copy(gemma3_tokenizer)
    tokenizer.name_or_path = "/models/google/gemma-2-9b-it"
    assert resolve_template(None, tokenizer).name == "gemma2"


def test_a_tokenizer_without_chat_template_falls_back_to_empty(mistral_tokenizer):
    assert not mistral_tokenizer.chat_template
    with pytest.warns(TemplateMismatchWarning, match="tokenizer has no chat template: using the 'empty' template"):
        assert resolve_template(None, mistral_tokenizer).name == "empty"


@pytest.mark.parametrize(("model_type", "expected"), [("qwen2", "qwen"), ("llama", "llama3"), ("gemma3_text", "gemma3"),
                                                   ("mistral", "mistral")])
def test_a_tokenizer_without_chat_template_takes_its_known_familys_template(mistral_tokenizer, model_type, expected):
    """No chat template, but config.json's model_type names a registered family (a tiny: model, a base
    model): that family's template, as a LLaMA-Factory user would name it, and no warning."""
    from registries.models.families import default_template_for

    assert not mistral_tokenizer.chat_template
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in (None, "auto"):
            assert resolve_template(name, mistral_tokenizer, model_type).name == expected == \
                default_template_for(model_type)
    assert auto_template_reason(mistral_tokenizer, expected, model_type).startswith(
        f"the tokenizer has no chat template; {expected!r} is the ")


def test_an_unknown_family_without_chat_template_still_falls_back_to_empty(mistral_tokenizer):
    with pytest.warns(TemplateMismatchWarning, match="tokenizer has no chat template: using the 'empty' template"):
        assert resolve_template("auto", mistral_tokenizer, "no_such_model_type").name == "empty"
    assert resolve_template("qwen", mistral_tokenizer, "mistral").name == "qwen"  # a named template is kept


def test_a_genuine_chat_template_wins_over_the_family(qwen3_tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_template("auto", qwen3_tokenizer, "qwen2").name == "qwen3"  # qwen2's default is qwen
    assert auto_template_reason(qwen3_tokenizer, "qwen3", "qwen2") == "it renders like the tokenizer's own chat template"


def test_an_unknown_chat_template_falls_back_to_empty_and_names_the_closest(llama3_tokenizer):
    """Llama-3.1's template (dated system block) is not registered: 'empty', with llama3 as the
    closest and the dated block in the diff."""
    import trl

    tokenizer = copy.deepcopy(llama3_tokenizer)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "llama3_1.jinja").read_text()
    with pytest.warns(TemplateMismatchWarning) as record:
        assert resolve_template("auto", tokenizer).name == "empty"
    message = str(record[0].message)
    assert "no registered template renders like the tokenizer's chat template" in message
    assert "The closest is 'llama3'" in message
    assert "+Cutting Knowledge Date: December 2023\\n" in message


def test_a_named_template_that_differs_warns_with_a_diff(qwen3_tokenizer):
    with pytest.warns(TemplateMismatchWarning) as record:
        template = resolve_template("qwen", qwen3_tokenizer)
    assert template.name == "qwen"  # the user's choice stands
    message = str(record[0].message)
    assert "Template 'qwen' renders conversations differently from the tokenizer's own chat template" in message
    assert "--- template 'qwen'\n+++ tokenizer chat_template" in message
    assert "-You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n" in message
    assert "+<think>\\n" in message


def test_a_named_template_that_matches_is_silent(qwen3_tokenizer, gemma3_tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_template("qwen3", qwen3_tokenizer).name == "qwen3"
        # Gemma-3's template accepts a system prompt: gemma folds it the same way.
        assert resolve_template("gemma", gemma3_tokenizer).name == "gemma"


def test_a_named_template_on_a_tokenizer_without_chat_template_is_silent(mistral_tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_template("mistral", mistral_tokenizer).name == "mistral"


def test_unknown_name_is_a_clear_error(tiny_tokenizer):
    with pytest.raises(ValueError, match="Unknown template 'qwen4'"):
        resolve_template("qwen4", tiny_tokenizer)


@pytest.mark.parametrize("name", ["llama2", "mistral", "chatml", "qwen3_nothink", "deepseek3"])
def test_an_exported_template_is_detected_as_its_source(tiny_tokenizer, name):
    """Round trip: a tokenizer carrying our exported template resolves back to the same family
    (or to one that renders identically)."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = to_jinja(get_template(name), tokenizer)
    matches = matching_templates(tokenizer)
    assert name in matches
    detected = resolve_template(None, tokenizer)
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert detected.render(tokenizer, probe) == get_template(name).render(tokenizer, probe)
