"""Model families: the facts RayFactory needs about each architecture it trains.

One ``register_model_family`` call per family. A family says which transformers config class
and ``model_type`` strings it covers, which chat template it uses by default (LLaMA-Factory's
template names, so existing YAML files keep working), which special tokens its tokenizer has
and which linear layers LoRA should target.

Token facts describe the *instruct* checkpoints (e.g. Qwen2's eos is ``<|im_end|>``, not the
base model's ``<|endoftext|>``), because those are what chat fine-tuning starts from; the
templates re-point eos where a family needs it anyway (``replace_eos``).

Every family registered here is a dense decoder: each weight of its ``...ForCausalLM`` is in
every step's loss, so its DDP runs skip the search for parameters without a gradient
(stages/job.py). A mixture-of-experts family would need a flag that says otherwise. Vision-language
families (``vision``: Qwen2-VL) load through ``AutoModelForImageTextToText`` instead; their vision
tower is not in a text row's loss, so they keep that search (their class is no ``...ForCausalLM``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

# Every projection of the attention block and the gated MLP: the usual "all linear" target set.
ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelFamily:
    name: str
    config_class: str  # transformers class name, e.g. "Qwen2Config"
    model_types: tuple[str, ...]  # config.model_type values this family covers
    template: str  # default chat template name (LLaMA-Factory's naming)
    eos_token: str
    bos_token: str | None = None
    pad_token: str | None = None  # None: the family ships without one (the template step sets it)
    unk_token: str | None = None
    add_bos: bool = False  # whether encoding a text prepends bos (llama3, mistral, gemma do)
    chat_tokens: tuple[str, ...] = ()  # special markers: never split, dropped by skip_special_tokens
    plain_tokens: tuple[str, ...] = ()  # single-id tokens that stay visible in decoded text (<think>)
    lora_targets: tuple[str, ...] = ATTENTION_AND_MLP
    # A vision-language family: the model class is transformers' AutoModelForImageTextToText (a vision
    # tower + the language model), its tiny model ships the family's image processor, and its
    # template names a vision plugin (registries/multimodal).
    vision: bool = False
    notes: str = field(default="", compare=False)

    @property
    def auto_class(self) -> str:
        """The transformers auto class that loads this family's checkpoints for training."""
        return "AutoModelForImageTextToText" if self.vision else "AutoModelForCausalLM"

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """bos/eos/pad/unk and the chat markers, each once, in a fixed order (ids follow it)."""
        ordered = [self.bos_token, self.eos_token, self.pad_token, self.unk_token, *self.chat_tokens]
        return tuple(dict.fromkeys(t for t in ordered if t))


MODEL_FAMILIES: dict[str, ModelFamily] = {}
_BY_MODEL_TYPE: dict[str, ModelFamily] = {}


def register_model_family(
    name: str,
    *,
    config_class: str,
    model_types: Sequence[str],
    template: str,
    eos_token: str,
    bos_token: str | None = None,
    pad_token: str | None = None,
    unk_token: str | None = None,
    add_bos: bool = False,
    chat_tokens: Sequence[str] = (),
    plain_tokens: Sequence[str] = (),
    lora_targets: Sequence[str] = ATTENTION_AND_MLP,
    vision: bool = False,
    notes: str = "",
) -> ModelFamily:
    """Declare one family. A name or a model_type that is already taken is an error."""
    if name in MODEL_FAMILIES:
        raise ValueError(f"Model family {name!r} is already registered.")
    if not model_types:
        raise ValueError(f"Model family {name!r} must list at least one model_type.")
    for model_type in model_types:
        if model_type in _BY_MODEL_TYPE:
            owner = _BY_MODEL_TYPE[model_type].name
            raise ValueError(f"model_type {model_type!r} of family {name!r} is already claimed by family {owner!r}.")
    if add_bos and not bos_token:
        raise ValueError(f"Model family {name!r} sets add_bos but has no bos_token.")
    if not lora_targets:
        raise ValueError(f"Model family {name!r} must name its LoRA target modules.")
    overlap = set(chat_tokens) & set(plain_tokens)
    if overlap:
        raise ValueError(f"Model family {name!r} lists {sorted(overlap)} as both chat and plain tokens.")
    family = ModelFamily(
        name=name,
        config_class=config_class,
        model_types=tuple(model_types),
        template=template,
        eos_token=eos_token,
        bos_token=bos_token,
        pad_token=pad_token,
        unk_token=unk_token,
        add_bos=add_bos,
        chat_tokens=tuple(chat_tokens),
        plain_tokens=tuple(plain_tokens),
        lora_targets=tuple(lora_targets),
        vision=vision,
        notes=notes,
    )
    MODEL_FAMILIES[name] = family
    for model_type in family.model_types:
        _BY_MODEL_TYPE[model_type] = family
    return family


def get_model_family(name: str) -> ModelFamily:
    if name not in MODEL_FAMILIES:
        raise ValueError(f"Unknown model family {name!r}.{_did_you_mean(name, MODEL_FAMILIES)} "
                         f"Known families: {', '.join(sorted(MODEL_FAMILIES))}.")
    return MODEL_FAMILIES[name]


def list_model_families() -> list[str]:
    return sorted(MODEL_FAMILIES)


def family_for_model_type(model_type: str) -> ModelFamily:
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"No model family knows model_type {model_type!r}.{_did_you_mean(model_type, _BY_MODEL_TYPE)} "
            f"Known model types: {', '.join(sorted(_BY_MODEL_TYPE))}. Set `template:` in your YAML "
            f"explicitly (and `lora_target:` for LoRA) to train this model anyway."
        )
    return _BY_MODEL_TYPE[model_type]


def is_registered_model_type(model_type: str) -> bool:
    return model_type in _BY_MODEL_TYPE


def family_for_config(config: Any) -> ModelFamily:
    """The family of a transformers config (or its dict form, or a bare model_type string)."""
    if isinstance(config, str):
        model_type = config
    elif isinstance(config, Mapping):
        model_type = config.get("model_type")
    else:
        model_type = getattr(config, "model_type", None)
    if not model_type:
        raise ValueError(
            f"Cannot tell the model family: the config ({type(config).__name__}) has no model_type. "
            f"Check that config.json in the model folder has a \"model_type\" field."
        )
    return family_for_model_type(model_type)


def default_template_for(model_type: str) -> str:
    """The chat template a model of this type uses when the YAML names none."""
    return family_for_model_type(model_type).template


def _did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


# ------------------------------------------------------------------------------ the families

_LLAMA3_MARKERS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)
_CHATML_MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>")
# Qwen2-VL's vision markers, in the order of their ids in the real tokenizer (151646-151656).
_QWEN_VISION_MARKERS = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

register_model_family(
    "llama",
    config_class="LlamaConfig",
    model_types=["llama"],
    template="llama3",
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    add_bos=True,
    chat_tokens=_LLAMA3_MARKERS,
    notes="Tokens are Llama 3's; Llama 2 (template llama2) and SmolLM2 (chatml) share model_type "
    "llama, so name their template explicitly.",
)

register_model_family(
    "qwen2",
    config_class="Qwen2Config",
    model_types=["qwen2"],
    template="qwen",
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    chat_tokens=_CHATML_MARKERS,
    plain_tokens=("<tool_call>", "</tool_call>"),
    notes="Qwen2 and Qwen2.5 (instruct eos; base checkpoints end texts with <|endoftext|>).",
)

register_model_family(
    "qwen3",
    config_class="Qwen3Config",
    model_types=["qwen3"],
    template="qwen3",
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    chat_tokens=_CHATML_MARKERS,
    plain_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
)

register_model_family(
    "mistral",
    config_class="MistralConfig",
    model_types=["mistral"],
    template="mistral",
    bos_token="<s>",
    eos_token="</s>",
    unk_token="<unk>",
    add_bos=True,
    chat_tokens=(
        "[INST]",
        "[/INST]",
        "[TOOL_CALLS]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
    ),
    notes="Control tokens of the v3 tokenizer (Mistral 7B Instruct v0.3).",
)

register_model_family(
    "gemma",
    config_class="GemmaConfig",
    model_types=["gemma"],
    template="gemma",
    bos_token="<bos>",
    eos_token="<eos>",
    pad_token="<pad>",
    unk_token="<unk>",
    add_bos=True,
    chat_tokens=_GEMMA_MARKERS,
)

register_model_family(
    "gemma2",
    config_class="Gemma2Config",
    model_types=["gemma2"],
    template="gemma2",
    bos_token="<bos>",
    eos_token="<eos>",
    pad_token="<pad>",
    unk_token="<unk>",
    add_bos=True,
    chat_tokens=_GEMMA_MARKERS,
)

register_model_family(
    "gemma3",
    config_class="Gemma3TextConfig",
    model_types=["gemma3_text"],  # "gemma3" is the multimodal wrapper: family gemma3_vl
    template="gemma3",
    bos_token="<bos>",
    eos_token="<end_of_turn>",  # Gemma 3 instruct tokenizers end on the turn marker
    pad_token="<pad>",
    unk_token="<unk>",
    add_bos=True,
    chat_tokens=("<eos>", *_GEMMA_MARKERS),
    notes="Text-only Gemma 3 (Gemma3ForCausalLM); model_type gemma3 is the multimodal wrapper (gemma3_vl).",
)

register_model_family(
    "phi3",
    config_class="Phi3Config",
    model_types=["phi3"],
    template="phi",
    bos_token="<s>",
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    unk_token="<unk>",
    chat_tokens=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    notes="Phi-3 / Phi-3.5 fuse q/k/v and gate/up into one linear each. Phi-4-mini is phi3 too "
    "but uses template phi4_mini.",
)

register_model_family(
    "qwen2_vl",
    config_class="Qwen2VLConfig",
    model_types=["qwen2_vl"],
    template="qwen2_vl",
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    chat_tokens=_CHATML_MARKERS + _QWEN_VISION_MARKERS,
    # The language model's projections only: the vision tower's linears are qkv/proj/fc1/fc2 and its
    # merger's are numbered, so LoRA stays on the language model, as LLaMA-Factory does by default.
    lora_targets=ATTENTION_AND_MLP,
    vision=True,
    notes="Qwen2-VL (Qwen2VLForConditionalGeneration): a ViT with 2x2 patch merging in front of a Qwen2 "
    "decoder with multimodal rotary positions; images arrive as <|vision_start|><|image_pad|>...<|vision_end|>.",
)

register_model_family(
    "llava",
    config_class="LlavaConfig",
    model_types=["llava"],
    template="llava",
    bos_token="<s>",
    eos_token="</s>",
    pad_token="<pad>",
    unk_token="<unk>",
    add_bos=True,
    # <image> is one special token (llava-hf's id 32000), so an image's run of them never merges or splits.
    chat_tokens=("<image>",),
    vision=True,
    notes="LLaVA-1.5 (LlavaForConditionalGeneration): a CLIP vision tower whose patch features (the CLS one "
    "dropped) go through a 2-layer MLP projector into a Llama-2 decoder; every image is one fixed-size crop, "
    "so it arrives as the same number of <image> tokens. lora_target names like q_proj also match the CLIP "
    "tower's attention: the vision-freeze options (stages/training/vision_freeze.py) keep LoRA off it.",
)

register_model_family(
    "gemma3_vl",
    config_class="Gemma3Config",
    model_types=["gemma3"],
    template="gemma3",
    bos_token="<bos>",
    eos_token="<end_of_turn>",
    pad_token="<pad>",
    unk_token="<unk>",
    add_bos=True,
    # Gemma 3's image markers are single special ids, as in the real tokenizer, so an image's run of
    # soft tokens never merges or splits (registries/multimodal/gemma3.py writes them).
    chat_tokens=("<eos>", *_GEMMA_MARKERS, "<start_of_image>", "<image_soft_token>", "<end_of_image>"),
    vision=True,
    notes="Gemma 3 with images (Gemma3ForConditionalGeneration, model_type gemma3): a SigLIP vision tower whose "
    "patch features are average-pooled to mm_tokens_per_image and projected into a Gemma 3 decoder; every "
    "image is resized to one square, so it arrives as the same framed run of <image_soft_token>. lora_target "
    "names like q_proj also match SigLIP's attention: the vision-freeze options keep LoRA off it.",
)
