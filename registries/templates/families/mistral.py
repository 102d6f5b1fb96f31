"""Mistral's instruct format (tokenizer v3: Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct)."""

from ..registry import register_template
from ..slots import BOS, EOS

register_template(
    "mistral",
    prefix=[BOS],
    user=["[INST] {{content}}[/INST]"],
    # The leading space is what Mistral's own template writes; the SentencePiece tokenizer turns
    # it into the word-start mark, which is exactly what mistral-common encodes.
    assistant=[" {{content}}", EOS],
    system=["{{content}}\n\n"],
    system_in_first_user=True,
    function=["[TOOL_CALLS] {{content}}", EOS],
    observation=['[TOOL_RESULTS] {"content": {{content}}}[/TOOL_RESULTS]'],
    tool_format="mistral",
    notes=(
        "Token-identical to mistral-common's encoding of a chat without a system prompt, or with one "
        "in a single-turn chat. mistral-common puts the system prompt in front of the LAST user "
        "message; here (as in LLaMA-Factory) it goes in front of the FIRST, so every turn of a "
        "multi-turn chat is encoded the same however long the chat grows. Tools: mistral-common writes "
        "'[AVAILABLE_TOOLS]...[/AVAILABLE_TOOLS]' before the last '[INST]' and gives calls and results "
        "call ids; here the tool list is part of the system text inside the first '[INST]' and there "
        "are no call ids (as in LLaMA-Factory)."
    ),
)
