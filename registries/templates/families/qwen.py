"""Qwen chat formats: ChatML turns, tool results wrapped in ``<tool_response>`` user turns.

``qwen`` is Qwen-1.5/2/2.5 (a default system prompt), ``qwen3`` the hybrid reasoning models
(``<think>`` blocks), ``qwen3_nothink`` the non-reasoning Qwen3 models (Instruct-2507), named
as in LLaMA-Factory.
"""

from ..registry import register_template

_USER = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"
_ASSISTANT = "{{content}}<|im_end|>\n"
_SYSTEM = "<|im_start|>system\n{{content}}<|im_end|>\n"
_OBSERVATION = "<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

# Everything but the reasoning switches and the default system prompt is shared.
_CHATML = dict(
    user=[_USER],
    assistant=[_ASSISTANT],
    system=[_SYSTEM],
    function=[_ASSISTANT],
    observation=[_OBSERVATION],
    tool_format="qwen",
    stop_words=["<|im_end|>"],
    replace_eos=True,
)

_BOUNDARY_NOTE = (
    "A reply is encoded apart from the prompt that ends in 'assistant\\n', so a reply that starts "
    "with a newline gets '\\n' + '\\n...' where tokenizing the whole text would merge them into one "
    "token; generation sees the same split (the prompt is tokenized alone)."
)

register_template(
    "qwen",
    default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    notes="Token-identical to Qwen2.5's chat template. " + _BOUNDARY_NOTE,
    **_CHATML,
)

register_template(
    "qwen3",
    thought_words=("<think>\n", "\n</think>\n\n"),
    notes=(
        "Token-identical to Qwen3's chat template: thoughts of replies before the last user query are "
        "dropped, and the final reply gets an empty '<think>\\n\\n</think>\\n\\n' block when it has no "
        "thought (in the response with thinking on, so the model learns to emit it; at the end of the "
        "prompt with enable_thinking=False, as Qwen3's no-thinking generation prompt writes it). "
        "Earlier replies therefore carry no thought block: train multi-turn data with mask_history "
        "to learn only the final reply. Qwen3 re-canonicalizes a thought's surrounding newlines; here "
        "a thought is kept as written. " + _BOUNDARY_NOTE
    ),
    **_CHATML,
)

register_template(
    "qwen3_nothink",
    notes=(
        "Qwen3 without reasoning (the Instruct-2507 models, LLaMA-Factory's qwen3_nothink): plain "
        "ChatML replies with no '<think>' block, token-identical to those models' chat template. For "
        "a hybrid Qwen3 model with thinking switched off use qwen3 with enable_thinking=False. "
        + _BOUNDARY_NOTE
    ),
    **_CHATML,
)

register_template(
    "qwen2_vl",
    default_system="You are a helpful assistant.",
    mm_plugin="qwen2_vl",
    notes="Qwen2-VL / Qwen2.5-VL: ChatML with the qwen2_vl vision plugin (each <image> becomes "
    "<|vision_start|><|image_pad|>*N<|vision_end|>). " + _BOUNDARY_NOTE,
    **_CHATML,
)
