"""Meta's Llama chat formats: Llama-2's ``[INST]`` turns and Llama-3's header blocks."""

from ..registry import register_template
from ..slots import BOS

# Llama-2 folds the system prompt into the first user turn inside <<SYS>> markers, and every
# user turn starts a new bos-delimited segment.
register_template(
    "llama2",
    user=[BOS, "[INST] {{content}} [/INST]"],
    system=["<<SYS>>\n{{content}}\n<</SYS>>\n\n"],
    system_in_first_user=True,
    notes=(
        "Same as LLaMA-Factory's llama2. Meta's own template writes a reply as ' ' + reply.strip() + ' ' "
        "before the eos and strips every message; here replies are the bare content followed by the "
        "eos (SentencePiece's dummy prefix supplies the leading space), and content is not stripped."
    ),
)

_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"
_ASSISTANT_HEADER = _HEADER.format(role="assistant")

# Llama-3 / 3.1 / 3.2 / 3.3 share the format; 3.1+ only add a dated system block (see notes).
register_template(
    "llama3",
    prefix=[BOS],
    system=[_HEADER.format(role="system") + "{{content}}<|eot_id|>"],
    user=[_HEADER.format(role="user") + "{{content}}<|eot_id|>" + _ASSISTANT_HEADER],
    assistant=["{{content}}<|eot_id|>"],
    function=["{{content}}<|eot_id|>"],
    observation=[_HEADER.format(role="ipython") + "{{content}}<|eot_id|>" + _ASSISTANT_HEADER],
    tool_format="llama3",
    stop_words=["<|eot_id|>", "<|eom_id|>"],
    replace_eos=True,
    notes=(
        "Token-identical to Llama-3's own chat template for content without surrounding whitespace. "
        "The official template trims every message ('| trim'); here content is kept as written "
        "(as in LLaMA-Factory), so data with leading/trailing whitespace trains on that whitespace. "
        "Llama-3.1+'s template always opens with a system block holding 'Cutting Knowledge Date: "
        "December 2023\\nToday Date: <date>\\n\\n'; pass that text in front of your system prompt to "
        "reproduce it exactly."
    ),
)
