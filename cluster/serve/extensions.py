"""Request fields beyond the ones the chat completions model reads: vLLM's sampling extensions and
OpenAI fields this server does not implement.

A client that sets one of them expects its reply to change (a benchmark's ``ignore_eos``, a
``min_p`` cut, JSON mode); answering as if it were absent would hand back a reply the client did not
ask for. So the ones our engines can do are fields of ``ChatCompletionRequest`` (``top_k``,
``repetition_penalty``, ``ignore_eos``), and every other one named here is accepted at its neutral
value (client libraries send defaults) and refused by name at any other. Fields named nowhere
(``user``, ``metadata``, ``store``...) change no reply and are ignored, as OpenAI's server does with
ones it does not know.
"""

from __future__ import annotations

from typing import Any

from registries.datasets.formats import short_json

# field -> (its neutral value, what to do instead)
REFUSED: dict[str, tuple[Any, str]] = {
    "frequency_penalty": (0, "use repetition_penalty (vLLM's name) instead"),
    "presence_penalty": (0, "use repetition_penalty (vLLM's name) instead"),
    "logit_bias": ({}, "send stop strings or constrain the reply in the prompt"),
    "response_format": ({"type": "text"}, "ask for JSON in the messages and parse the reply"),
    "min_p": (0, "use top_p or top_k"),
    "min_tokens": (0, "leave it out"),
    "use_beam_search": (False, "sample with n > 1 instead"),
    "best_of": (1, "ask for n replies and pick one yourself"),
    "length_penalty": (1, "leave it out (it applies to beam search only)"),
    "stop_token_ids": ([], "send stop strings (stop) instead"),
    "bad_words": ([], "leave it out"),
    "allowed_token_ids": (None, "leave it out"),
    "include_stop_str_in_output": (False, "append the stop string yourself"),
    "skip_special_tokens": (True, "leave it out: replies never show special tokens"),
    "spaces_between_special_tokens": (True, "leave it out"),
    "prompt_logprobs": (None, "leave it out"),
    "truncate_prompt_tokens": (None, "shorten the messages yourself"),
    "guided_json": (None, "ask for JSON in the messages and parse the reply"),
    "guided_regex": (None, "leave it out"),
    "guided_choice": (None, "leave it out"),
    "guided_grammar": (None, "leave it out"),
    "structured_outputs": (None, "ask for JSON in the messages and parse the reply"),
    "chat_template": (None, "the server uses its model's template; set template in its config"),
    "chat_template_kwargs": (None, "set the template's options in the server's config"),
    "echo": (False, "leave it out"),
    "continue_final_message": (False, "leave it out"),
    "add_generation_prompt": (True, "leave it out"),
}


def refused_extension(extra: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) for the first field of ``extra`` set to something this server would have
    to ignore; None when there is none."""
    for name, value in extra.items():
        if name not in REFUSED:
            continue
        neutral, instead = REFUSED[name]
        if value is None or value == neutral or (isinstance(neutral, (list, dict)) and not value):
            continue
        return name, (f"{name} is not supported by this server (set to {short_json(value)}, it would change the reply, so it is "
                      f"refused rather than ignored); {instead}.")
    return None
