"""Sampling fields beyond the basic OpenAI ones: vLLM's extensions our engines honour (top_k,
repetition_penalty, ignore_eos) reach the engine; the others, and OpenAI fields this server does
not implement, are refused by name unless set to their neutral value; fields that change no reply
are ignored. The HTTP path of the same checks is in test_serve.py."""

from __future__ import annotations

import json

import pytest

from cluster.api import ChatModel
from cluster.serve.extensions import REFUSED
from cluster.serve.protocol import APIError, ChatCompletionRequest, chat_options, parse_body
from cluster.serve.serve_args import RequestLimits

from .conftest import BASE, PROMPTS

LIMITS = RequestLimits(max_request_bytes=1 << 20, max_n=8, max_stop=4, max_stop_length=32, timeout_s=60)
MESSAGES = [{"role": "user", "content": "hi"}]


def _checked(**fields) -> ChatCompletionRequest:
    body = parse_body(json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode(), ChatCompletionRequest)
    body.check_limits(LIMITS)
    return body


# A value for each refused field that would change the reply.
CHANGING = {
    "frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"42": 100}, "response_format": {"type": "json_object"},
    "min_p": 0.1, "min_tokens": 5, "use_beam_search": True, "best_of": 3, "length_penalty": 0.5,
    "stop_token_ids": [7], "bad_words": ["no"], "allowed_token_ids": [1, 2], "include_stop_str_in_output": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "prompt_logprobs": 1,
    "truncate_prompt_tokens": 10, "guided_json": {"type": "object"}, "guided_regex": "[0-9]+",
    "guided_choice": ["a", "b"], "guided_grammar": "root ::= 'a'", "structured_outputs": {"json": {}},
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False}, "echo": True,
    "continue_final_message": True, "add_generation_prompt": False,
}


def test_every_refused_field_has_a_changing_value_here():
    assert CHANGING.keys() == REFUSED.keys()


@pytest.mark.parametrize("name", sorted(CHANGING))
def test_a_field_that_would_change_the_reply_is_refused_by_name(name):
    with pytest.raises(APIError) as info:
        _checked(**{name: CHANGING[name]})
    assert (info.value.status, info.value.param, info.value.code) == (400, name, "unsupported_parameter")
    assert info.value.message.startswith(f"{name} is not supported by this server (set to ")
    assert "refused rather than ignored" in info.value.message


def test_neutral_values_and_fields_that_change_nothing_are_accepted():
    neutral = {name: value for name, (value, _) in REFUSED.items()}
    body = _checked(**neutral, user="alice", metadata={"run": "7"}, store=False)
    assert body.model_extra["user"] == "alice"
    _checked(**{name: None for name in REFUSED})
    _checked(logit_bias={}, stop_token_ids=[], bad_words=[], response_format={"type": "text"})


def test_the_honoured_extensions_become_chat_model_options():
    options = chat_options(_checked(top_k=5, repetition_penalty=1.3, ignore_eos=True), adapter=None)
    assert (options["top_k"], options["repetition_penalty"], options["ignore_eos"]) == (5, 1.3, True)
    unset = chat_options(_checked(), adapter=None)
    assert (unset["top_k"], unset["repetition_penalty"], unset["ignore_eos"]) == (None, None, False)
    for bad in ({"top_k": -2}, {"repetition_penalty": 0}):
        with pytest.raises(APIError) as info:
            _checked(**bad)
        assert info.value.status == 400 and info.value.param == next(iter(bad))


@pytest.fixture(scope="module")
def chat():
    return ChatModel({"model_name_or_path": BASE, "template": "qwen", "do_sample": False, "max_new_tokens": 12})


def test_ignore_eos_runs_past_the_stop_token_to_max_tokens(chat):
    """A stop token the greedy reply meets at its third token: without ignore_eos the reply ends
    there ("stop"); with it the reply is the whole greedy continuation ("length"), stop token included."""
    whole = chat.chat(PROMPTS[1], ignore_eos=True)[0]
    assert whole.response_length == 12 and whole.finish_reason == "length"
    stop = whole.token_ids[2]
    first = whole.token_ids.index(stop)
    chat.stop_token_ids = (*chat.stop_token_ids, stop)  # the model's facts, changed for this test only
    try:
        assert chat.chat(PROMPTS[1])[0].token_ids == whole.token_ids[: first + 1]
        assert chat.chat(PROMPTS[1])[0].finish_reason == "stop"
        again = chat.chat(PROMPTS[1], ignore_eos=True)[0]
        streamed = "".join(chat.stream_chat(PROMPTS[1], ignore_eos=True))
    finally:
        chat.stop_token_ids = chat.stop_token_ids[:-1]
    assert again.token_ids == whole.token_ids and again.finish_reason == "length"
    assert streamed == again.response_text


def test_top_k_and_repetition_penalty_reach_the_engine(chat):
    sampling = chat.request(PROMPTS[0], top_k=3, repetition_penalty=1.5).sampling
    assert (sampling.top_k, sampling.repetition_penalty) == (3, 1.5)
    plain, penalised = (chat.chat(PROMPTS[0], repetition_penalty=r)[0].token_ids for r in (1.0, 5.0))
    assert plain != penalised  # a strong penalty changes the greedy reply of the tiny model
