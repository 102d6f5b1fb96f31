"""Chinese Llama-2 chat (llama2_zh): Llama-2's [INST] format with a bilingual default system prompt."""

from ..registry import register_template
from ..slots import BOS

register_template(
    "llama2_zh",
    user=[BOS, "[INST] {{content}} [/INST]"],
    system=["<<SYS>>\n{{content}}\n<</SYS>>\n\n"],
    default_system="You are a helpful assistant. 你是一个乐于助人的助手。",
    system_in_first_user=True,
)
