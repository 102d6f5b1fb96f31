"""OpenAI gpt-oss: the "harmony" format (channels inside assistant messages).

Laid out like the model's own chat template so a fine-tuned model meets at inference what it
saw in training: a fixed system block first, the user's system prompt as a developer
message, and each reply on the ``final`` channel, after its ``analysis`` message (the thought)
when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formatters import FunctionFormatter, StringFormatter
from ..registry import register_template
from ..slots import Slot

# The official template writes today's date into the system block. Training data must not
# change with the calendar, so the date is fixed (gpt-oss's release date).
GPT_OSS_DATE = "2025-08-05"

_SYSTEM_BLOCK = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n"
    f"Current date: {GPT_OSS_DATE}\n\n"
    "Reasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
)

# A thought is a whole analysis message; the reply proper then opens a new assistant message.
THOUGHT_WORDS = ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant")
FINAL_HEADER = "<|channel|>final<|message|>"


def split_thought(content: str) -> tuple[str, str]:
    """(analysis message, the rest). The rest may start with the final-channel header, as
    LLaMA-Factory's gpt_oss data does (its thought words end with it): it is dropped, since
    the reply slot writes it."""
    thought = ""
    if content.startswith(THOUGHT_WORDS[0]):
        end = content.find(THOUGHT_WORDS[1])
        if end != -1:
            end += len(THOUGHT_WORDS[1])
            thought, content = content[:end], content[end:]
    return thought, content.removeprefix(FINAL_HEADER)


@dataclass(frozen=True)
class _Reply(StringFormatter):
    """The thought goes in front of the reply's slots: the final-channel header sits between
    them, so a reply whose thought was dropped (history) or never existed is still a
    well-formed final message."""

    def apply(self, content: str = "", **values: str) -> list[Slot]:
        thought, answer = split_thought(content)
        return ([thought] if thought else []) + super().apply(answer, **values)


@dataclass(frozen=True)
class _Call(FunctionFormatter):
    """A tool call after an optional analysis message, on the commentary channel."""

    def apply(self, content: str = "", thought_words: tuple[str, str] | None = None) -> list[Slot]:
        thought, calls = split_thought(content)
        return ([thought] if thought else []) + super().apply(calls)


_REPLY_SLOTS = (FINAL_HEADER + "{{content}}<|return|>",)
# harmony sends tool calls to the commentary channel and ends them with <|call|>
_CALL_SLOTS = ("<|channel|>commentary<|message|>{{content}}<|call|>",)

register_template(
    "gpt_oss",
    prefix=[_SYSTEM_BLOCK],
    system=["<|start|>developer<|message|># Instructions\n\n{{content}}\n\n<|end|>"],
    user=["<|start|>user<|message|>{{content}}<|end|><|start|>assistant"],
    assistant=_REPLY_SLOTS,
    function=_CALL_SLOTS,
    assistant_formatter=_Reply(_REPLY_SLOTS),
    function_formatter=_Call(_CALL_SLOTS, "default"),
    thought_words=THOUGHT_WORDS,
    stop_words=["<|return|>", "<|call|>"],
    replace_eos=True,
    notes=(
        "Matches gpt-oss's chat template (with 'Current date' fixed to GPT_OSS_DATE) for replies "
        "with a thought and for earlier replies, whose thoughts both drop. Differences: replies end "
        "with '<|return|>' also in history (official: '<|end|>'); a final reply without a thought "
        "gets an empty analysis message; tools use the default (ReAct) tool format in the developer "
        "message and calls go to the commentary channel as text, not harmony's TypeScript namespace "
        "and 'to=functions.NAME' headers. The thought comes before the reply slot (custom "
        "formatters above), so contents written LLaMA-Factory's way, with "
        "'<|end|><|start|>assistant<|channel|>final<|message|>' closing the thought, also work. "
        "LLaMA-Factory's gpt_oss has a short system message ('You are ChatGPT, ...') instead of "
        "the official system block."
    ),
)
