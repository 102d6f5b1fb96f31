"""DeepSeek families: the v1/v2 chat format, DeepSeek-Coder, and the V3 / R1 marker format."""

from ..registry import register_template
from ..slots import BOS, EOS

# DeepSeek LLM / V2 chat. The official template writes "Assistant: " + reply; the generation
# prompt (and so this template) ends at "Assistant:".
register_template(
    "deepseek",
    user=["User: {{content}}\n\nAssistant:"],
    # DeepSeek-LLM's own template writes 'Assistant: ' + reply: the space belongs to the reply,
    # since generation starts right after 'Assistant:'.
    assistant=[" {{content}}", EOS],
    system=["{{content}}\n\n"],
    prefix=[BOS],
    notes="The reply starts with a space, as DeepSeek-LLM's template renders it (LLaMA-Factory omits it).",
)

register_template(
    "deepseekcoder",
    user=["### Instruction:\n{{content}}\n### Response:"],
    assistant=["\n{{content}}\n<|EOT|>\n"],
    prefix=[BOS],
    default_system=(
        "You are an AI programming assistant, utilizing the DeepSeek Coder model, "
        "developed by DeepSeek Company, and you only answer questions related to computer science. "
        "For politically sensitive questions, security and privacy issues, "
        "and other non-computer science questions, you will refuse to answer.\n"
    ),
)

# V3 and R1 share the layout: bos, the bare system text, then <｜User｜>/<｜Assistant｜> turns
# closed by the eos <｜end▁of▁sentence｜>.
_V3_USER = "<｜User｜>{{content}}<｜Assistant｜>"

register_template(
    "deepseek3",
    user=[_V3_USER],
    prefix=[BOS],
    notes=(
        "Not a reasoning template. The V3 chat template shipped with trl opens a thought in the "
        "generation prompt ('<｜Assistant｜><think>\\n') and keeps only the text after '</think>' in "
        "replies; here the prompt ends at '<｜Assistant｜>' and replies are kept verbatim."
    ),
)

register_template(
    "deepseekr1",
    user=[_V3_USER],
    prefix=[BOS],
    thought_words=("<think>\n", "\n</think>\n\n"),
    notes=(
        "The last reply keeps its '<think>\\n...\\n</think>\\n\\n' block, so reasoning is trained "
        "(the official template keeps only what follows '</think>' in every reply); earlier replies "
        "lose it, blank lines after '</think>' included, as clients send them at inference. A last "
        "reply without a thought gets the empty block '<think>\\n\\n</think>\\n\\n'; the official "
        "generation prompt instead ends with '<think>\\n'."
    ),
)
