"""Plain-text instruction formats: role names written as words, no special marker tokens.

These families predate chat-marker tokens; the end of a reply is the tokenizer's eos
(written per turn, or once per sample with ``efficient_eos``).
"""

from ..registry import register_template
from ..slots import BOS, EOS

register_template(
    "alpaca",
    user=["### Instruction:\n{{content}}\n\n### Response:\n"],
    assistant=["{{content}}", EOS, "\n\n"],
    default_system=(
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    ),
)

register_template(
    "vicuna",
    user=["USER: {{content}} ASSISTANT:"],
    default_system=(
        "A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions."
    ),
    notes=(
        "FastChat's vicuna_v1.1 puts a space between the system text and 'USER:' and one after "
        "'ASSISTANT:' inside replies; like LLaMA-Factory we write neither (SentencePiece models "
        "add the word-boundary space to the reply's first token anyway)."
    ),
)

# LLaVA-1.5 is trained on vicuna's format; LLaMA-Factory's "llava" template is vicuna plus the
# llava vision plugin, so the slots are the same text.
register_template(
    "llava",
    user=["USER: {{content}} ASSISTANT:"],
    default_system=(
        "A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions."
    ),
    mm_plugin="llava",
    notes="vicuna's format with the llava vision plugin (each <image> becomes a fixed count of <image> tokens).",
)

register_template(
    "solar",
    user=["### User:\n{{content}}\n\n### Assistant:\n"],
    system=["### System:\n{{content}}\n\n"],
    efficient_eos=True,
)

register_template(
    "falcon",
    user=["User: {{content}}\nFalcon:"],
    assistant=["{{content}}\n"],
    efficient_eos=True,
)

# OpenChat 3.5: the turn separator is the tokenizer's eos, <|end_of_turn|>.
register_template(
    "openchat",
    user=["GPT4 Correct User: {{content}}", EOS, "GPT4 Correct Assistant:"],
    prefix=[BOS],
)

# Baichuan 2: user turns are wrapped in two reserved tokens; the reply ends with eos once.
register_template(
    "baichuan2",
    user=["<reserved_106>{{content}}<reserved_107>"],
    efficient_eos=True,
)

register_template(
    "index",
    user=["reserved_0{{content}}reserved_1"],
    system=["<unk>{{content}}"],
    efficient_eos=True,
)
