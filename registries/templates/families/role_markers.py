"""Families whose turns open with a role marker and close with an end-of-turn token.

Cohere, IBM Granite, LG EXAONE, Zephyr, OLMo and OpenChat 3.6 (Llama-3 headers).
"""

from ..registry import register_template
from ..slots import BOS, EOS

# Command-R / Aya: the end-of-turn token is also the tokenizer's eos.
register_template(
    "cohere",
    user=[
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{content}}<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    ],
    system=["<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{{content}}<|END_OF_TURN_TOKEN|>"],
    prefix=[BOS],
    notes=(
        "The official template strips whitespace around every message (content.strip()); here "
        "content is kept verbatim, so data with padded messages trains on the padding."
    ),
)

_GRANITE_USER = (
    "<|start_of_role|>user<|end_of_role|>{{content}}<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
)
_GRANITE_ASSISTANT = "{{content}}<|end_of_text|>\n"
_GRANITE_SYSTEM = "<|start_of_role|>system<|end_of_role|>{{content}}<|end_of_text|>\n"

register_template(
    "granite3",
    user=[_GRANITE_USER],
    assistant=[_GRANITE_ASSISTANT],
    system=[_GRANITE_SYSTEM],
)

register_template(
    "granite4",
    user=[_GRANITE_USER],
    assistant=[_GRANITE_ASSISTANT],
    system=[_GRANITE_SYSTEM],
    observation=[
        "<|start_of_role|>tool<|end_of_role|>{{content}}<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
    ],
    stop_words=["<|end_of_text|>"],
    default_system="You are Granite, developed by IBM. You are a helpful AI assistant.",
    notes=(
        "A tool result is followed by '<|start_of_role|>assistant<|end_of_role|>' like every prompt "
        "turn (LLaMA-Factory writes '<|start_of_role|>assistant\\n' there)."
    ),
)

# EXAONE 3: the eos is [|endofturn|].
register_template(
    "exaone",
    user=["[|user|]{{content}}\n[|assistant|]"],
    assistant=["{{content}}", EOS, "\n"],
    system=["[|system|]{{content}}[|endofturn|]\n"],
)

register_template(
    "zephyr",
    user=["<|user|>\n{{content}}", EOS, "<|assistant|>\n"],
    system=["<|system|>\n{{content}}", EOS],
    default_system="You are Zephyr, a helpful assistant.",
    notes="Zephyr's own template also writes a newline after each '</s>'; like LLaMA-Factory we do not.",
)

# OLMo (v1 instruct) opens every sample with its eos token, <|endoftext|>.
register_template(
    "olmo",
    user=["<|user|>\n{{content}}<|assistant|>\n"],
    prefix=[EOS],
)

register_template(
    "openchat-3.6",
    user=[
        "<|start_header_id|>GPT4 Correct User<|end_header_id|>\n\n{{content}}<|eot_id|>"
        "<|start_header_id|>GPT4 Correct Assistant<|end_header_id|>\n\n"
    ],
    prefix=[BOS],
    stop_words=["<|eot_id|>"],
)
