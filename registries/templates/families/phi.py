"""Microsoft Phi families: Phi-3 / 3.5 (<|user|> ... <|end|>), Phi-3-small, Phi-4, Phi-4-mini."""

from ..registry import register_template
from ..slots import BOS

_PHI3_USER = "<|user|>\n{{content}}<|end|>\n<|assistant|>\n"
_PHI3_ASSISTANT = "{{content}}<|end|>\n"
_PHI3_SYSTEM = "<|system|>\n{{content}}<|end|>\n"

register_template(
    "phi",
    user=[_PHI3_USER],
    assistant=[_PHI3_ASSISTANT],
    system=[_PHI3_SYSTEM],
    stop_words=["<|end|>"],
    replace_eos=True,
    notes=(
        "The official Phi-3 template ends a training conversation with the tokenizer's original eos "
        "('<|endoftext|>') after the last '<|end|>\\n'; here every reply ends with '<|end|>', which "
        "replace_eos makes the eos, and nothing follows the last turn."
    ),
)

register_template(
    "phi_small",
    user=[_PHI3_USER],
    assistant=[_PHI3_ASSISTANT],
    system=[_PHI3_SYSTEM],
    prefix=[BOS],
    stop_words=["<|end|>"],
    replace_eos=True,
    notes=(
        "Starts with bos ('<|endoftext|>' for Phi-3-small) as the official template does; "
        "LLaMA-Factory's prefix for this family is silently dropped by its encoder."
    ),
)

register_template(
    "phi4",
    user=["<|im_start|>user<|im_sep|>{{content}}<|im_end|><|im_start|>assistant<|im_sep|>"],
    assistant=["{{content}}<|im_end|>"],
    system=["<|im_start|>system<|im_sep|>{{content}}<|im_end|>"],
    stop_words=["<|im_end|>"],
    replace_eos=True,
)

register_template(
    "phi4_mini",
    user=["<|user|>{{content}}<|end|><|assistant|>"],
    assistant=["{{content}}<|end|>"],
    system=["<|system|>{{content}}<|end|>"],
    stop_words=["<|end|>"],
    replace_eos=True,
    notes=(
        "Tools use the default (ReAct) tool format; Phi-4-mini's own '<|tool|>...<|/tool|>' tool "
        "list is not modelled."
    ),
)
