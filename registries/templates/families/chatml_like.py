"""ChatML descendants: ``<|im_start|>role\\n ... <|im_end|>\\n`` turns (``chatml`` itself is in general.py).

They differ only in a bos prefix, a default system prompt, and whether ``<|im_end|>`` replaces
the tokenizer's eos.
"""

from ..registry import register_template
from ..slots import BOS

_USER = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"
_ASSISTANT = "{{content}}<|im_end|>\n"
_SYSTEM = "<|im_start|>system\n{{content}}<|im_end|>\n"
_TOOL = "<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n"


def _chatml(name: str, **kwargs) -> None:
    register_template(name, user=[_USER], assistant=[_ASSISTANT], system=[_SYSTEM], **kwargs)


_chatml("yi", stop_words=["<|im_end|>"])

_chatml("smollm", stop_words=["<|im_end|>"])

_chatml(
    "smollm2",
    stop_words=["<|im_end|>"],
    default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    notes=(
        "The default system prompt is the one in SmolLM2-Instruct's own chat template, which has no "
        "final period (LLaMA-Factory's copy adds one)."
    ),
)

_chatml(
    "intern2",
    prefix=[BOS],
    stop_words=["<|im_end|>"],
    default_system=(
        "You are an AI assistant whose name is InternLM (书生·浦语).\n"
        "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI Laboratory "
        "(上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
        "- InternLM (书生·浦语) can understand and communicate fluently in the language "
        "chosen by the user such as English and 中文."
    ),
)

_chatml("cpm4", prefix=[BOS], observation=[_TOOL], stop_words=["<|im_end|>"])
