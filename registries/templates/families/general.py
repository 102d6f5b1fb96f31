"""Generic formats not tied to one model family."""

from ..registry import register_template
from ..slots import EOS

register_template(
    "default",
    user=["Human: {{content}}", EOS, "\nAssistant:"],
    assistant=["{{content}}", EOS, "\n"],
    system=["System: {{content}}", EOS, "\n"],
)

register_template("empty", assistant=["{{content}}"])

register_template(
    "chatml",
    user=["<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"],
    assistant=["{{content}}<|im_end|>\n"],
    system=["<|im_start|>system\n{{content}}<|im_end|>\n"],
    observation=["<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n"],
    stop_words=["<|im_end|>", "<|im_start|>"],
    replace_eos=True,
)
