"""Zhipu GLM families: ChatGLM3 and GLM-4 (``[gMASK]<sop>`` prefix, role tokens, glm4 tools).

Replies carry no end marker: the next role token (<|user|> / <|observation|>) is what stops
generation, and the eos is appended once per sample (``efficient_eos``).
"""

from ..registry import register_template
from ..slots import NamedToken

register_template(
    "glm4",
    user=["<|user|>\n{{content}}<|assistant|>"],
    assistant=["\n{{content}}"],
    system=["<|system|>\n{{content}}"],
    function=["{{content}}"],
    observation=["<|observation|>\n{{content}}<|assistant|>"],
    prefix=["[gMASK]<sop>"],
    tool_format="glm4",
    stop_words=["<|user|>", "<|observation|>"],
    efficient_eos=True,
)

# ChatGLM3's tokenizer is SentencePiece with role tokens that plain text does not produce,
# so they are placed by name.
register_template(
    "chatglm3",
    user=[NamedToken("<|user|>"), "\n", "{{content}}", NamedToken("<|assistant|>")],
    assistant=["\n", "{{content}}"],
    system=[NamedToken("<|system|>"), "\n", "{{content}}"],
    function=["{{content}}"],
    observation=[NamedToken("<|observation|>"), "\n", "{{content}}", NamedToken("<|assistant|>")],
    prefix=[NamedToken("[gMASK]"), NamedToken("sop")],
    tool_format="glm4",
    stop_words=["<|user|>", "<|observation|>"],
    efficient_eos=True,
)
