"""Google's Gemma chat formats: ``<start_of_turn>user|model`` turns, system folded into turn 0."""

from ..registry import register_template
from ..slots import BOS

_USER = "<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n"
_ASSISTANT = "{{content}}<end_of_turn>\n"
_OBSERVATION = "<start_of_turn>tool\n{{content}}<end_of_turn>\n<start_of_turn>model\n"

_GEMMA = dict(
    prefix=[BOS],
    user=[_USER],
    assistant=[_ASSISTANT],
    # Gemma has no system role: like Gemma-3's own template, the system prompt and a blank line
    # go in front of the first user message.
    system=["{{content}}\n\n"],
    system_in_first_user=True,
    observation=[_OBSERVATION],
)

_TRIM_NOTE = (
    "Gemma's templates trim every message ('| trim'); here content is kept as written (as in "
    "LLaMA-Factory), so only content without surrounding whitespace is token-identical."
)

register_template(
    "gemma",
    stop_words=["<end_of_turn>"],
    replace_eos=True,
    notes=(
        "Gemma-1/2's own template rejects a system message; here it is folded into the first user "
        "turn as Gemma-3 does. " + _TRIM_NOTE
    ),
    **_GEMMA,
)

register_template(
    "gemma2",
    stop_words=["<eos>", "<end_of_turn>"],
    efficient_eos=True,
    notes=(
        "As gemma, but, like LLaMA-Factory's gemma2, the tokenizer's <eos> stays the eos and is "
        "appended once after the last reply by the tokenization step (efficient_eos); the official "
        "template writes no <eos>. " + _TRIM_NOTE
    ),
    **_GEMMA,
)

register_template(
    "gemma3",
    stop_words=["<end_of_turn>"],
    replace_eos=True,
    # LLaMA-Factory's gemma3 template names the gemma3 vision plugin: text rows never consult it.
    mm_plugin="gemma3",
    notes="Token-identical to Gemma-3's own template, system prompt included. " + _TRIM_NOTE,
    **_GEMMA,
)
