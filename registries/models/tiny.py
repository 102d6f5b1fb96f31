"""Tiny random-init models of each family, built offline in about a second.

Tests, the quickstart and benchmarks need real ``save_pretrained`` folders (config, safetensors
weights, tokenizer) without downloading anything. ``build_tiny_model`` writes one;
``tiny_model_path`` builds it once into a cache and reuses it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterable

from .corpus import default_corpus
from .families import get_model_family
from .tokenizer import train_tokenizer

# Bump when a change here changes what gets built, so stale cache entries are not reused.
BUILD_VERSION = 1

# torch's default generator is process-wide: hold it while seeding and initialising so two
# threads building at once cannot interleave their random draws.
_INIT_LOCK = threading.Lock()


def build_tiny_model(
    family: str,
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
) -> Path:
    """Write a random-init ``family`` model and its freshly trained tokenizer into ``out_dir``.

    ``vocab_size`` is the BPE target; the model's embedding matches the tokenizer's final size
    (smaller when a small corpus runs out of merges). ``num_kv_heads`` defaults to half the
    heads so grouped-query attention paths are exercised. Same arguments, same files.
    """
    import torch
    import transformers

    spec = get_model_family(family)
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}).")
    num_kv_heads = num_kv_heads or max(1, num_heads // 2)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    head_dim = hidden_size // num_heads

    tokenizer = train_tokenizer(
        spec, default_corpus() if corpus is None else corpus, vocab_size, max_position_embeddings
    )
    if spec.vision:
        return _build_tiny_vision_model(spec, out_dir, tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                                        num_heads=num_heads, num_kv_heads=num_kv_heads,
                                        intermediate_size=intermediate_size or 2 * hidden_size,
                                        max_position_embeddings=max_position_embeddings, seed=seed)
    config_class = getattr(transformers, spec.config_class)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Fields some families scale by that default to their full-size values.
    if hasattr(config, "query_pre_attn_scalar"):
        config.query_pre_attn_scalar = head_dim
    if hasattr(config, "original_max_position_embeddings"):
        config.original_max_position_embeddings = max_position_embeddings

    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save(model, tokenizer, out_dir)


def _save(model, tokenizer, out_dir) -> Path:
    """The model with the tokenizer's special ids in its generation config, and the tokenizer."""
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _build_tiny_vision_model(spec, out_dir, tokenizer, *, hidden_size, num_layers, num_heads, num_kv_heads,
                             intermediate_size, max_position_embeddings, seed) -> Path:
    """A random-init vision-language model (Qwen2-VL: Qwen2VLForConditionalGeneration) with a tiny
    language model of the given shape, a tiny vision tower, and the family's real image processor.

    The vision tower keeps the processor's geometry (14-pixel patches, 2 frames per temporal
    patch, 2x2 merging: 1176 values per patch), so the genuine Qwen2VLImageProcessor feeds it."""
    if spec.name == "llava":  # a fixed-size CLIP crop per image, no grid: its own builder
        return _build_tiny_llava(spec, out_dir, tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                                 num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                                 max_position_embeddings=max_position_embeddings, seed=seed)
    if spec.name == "gemma3_vl":  # a fixed-size square per image, pooled: its own builder
        return _build_tiny_gemma3_vl(spec, out_dir, tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                                     num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     intermediate_size=intermediate_size,
                                     max_position_embeddings=max_position_embeddings, seed=seed)
    import torch
    import transformers

    head_dim = hidden_size // num_heads
    if head_dim % 4:
        raise ValueError(f"{spec.name}: the head size hidden_size/num_heads ({head_dim}) must be a multiple of 4.")
    half = head_dim // 2  # multimodal rotary positions split each head's frequencies over (t, h, w)
    hw = half * 3 // 8  # Qwen2-VL's own split of 64 is (16, 24, 24)
    vision_heads = 2
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = getattr(transformers, spec.config_class)(
        text_config=_text_config(
            tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * hw, hw, hw]},
        ),
        vision_config=dict(
            depth=num_layers, embed_dim=vision_heads * 16, num_heads=vision_heads, mlp_ratio=2,
            hidden_size=hidden_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        ),
        **ids,
    )
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, spec.auto_class).from_config(config, dtype=torch.float32)
    out = _save(model, tokenizer, out_dir)
    # The family's genuine image processor (no download: its defaults are Qwen2-VL's); the PIL
    # backend by name, because torchvision is not installed.
    transformers.Qwen2VLImageProcessorPil().save_pretrained(out)
    return out


def _text_config(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
                 max_position_embeddings, **extra) -> dict:
    """A vision-language model's language half, of the tiny shape and the tokenizer's special ids."""
    return dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra,
    )


# The tiny LLaVA's crop: 56 pixels in 14-pixel patches is 4x4 = 16 patch features (+ CLS, dropped by
# the "default" feature strategy), so each image is 16 <image> tokens instead of LLaVA-1.5's 576.
TINY_LLAVA_IMAGE_SIZE = 56


def _build_tiny_llava(spec, out_dir, tokenizer, *, hidden_size, num_layers, num_heads, num_kv_heads,
                      intermediate_size, max_position_embeddings, seed) -> Path:
    """A random-init LLaVA-1.5 (LlavaForConditionalGeneration): a tiny CLIP vision tower, LLaVA's
    2-layer MLP projector and a tiny Llama language model of the given shape, with CLIP's image
    processor cropping to TINY_LLAVA_IMAGE_SIZE.

    Everything the llava vision plugin (registries/multimodal/llava.py) assumes of a checkpoint
    holds: patch 14, the "default" feature strategy (CLS dropped), one additional token, so its
    count of <image> tokens per image is exactly the number of features the forward projects."""
    import torch
    import transformers

    from registries.multimodal.llava import FEATURE_STRATEGY, IMAGE_TOKEN, PATCH_SIZE

    vision_heads = 2
    config = transformers.LlavaConfig(
        text_config=_text_config(
            tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, max_position_embeddings,
            model_type="llama", head_dim=hidden_size // num_heads,
        ),
        vision_config=dict(
            model_type="clip_vision_model", hidden_size=vision_heads * 16, intermediate_size=vision_heads * 32,
            num_hidden_layers=num_layers, num_attention_heads=vision_heads, image_size=TINY_LLAVA_IMAGE_SIZE,
            patch_size=PATCH_SIZE, projection_dim=hidden_size,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(TINY_LLAVA_IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_select_strategy=FEATURE_STRATEGY,
        vision_feature_layer=-2,  # LLaVA-1.5's: the tower's second-to-last layer
    )
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, spec.auto_class).from_config(config, dtype=torch.float32)
    out = _save(model, tokenizer, out_dir)
    # CLIP's genuine processor (resize the short side, centre-crop, CLIP's mean/std), at the tiny
    # crop; the PIL backend by name, because torchvision is not installed.
    size = TINY_LLAVA_IMAGE_SIZE
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(out)
    return out


# The tiny Gemma 3's square: 56 pixels in 14-pixel SigLIP patches is 4x4 patches, average-pooled 2x2
# to TINY_GEMMA3_TOKENS_PER_IMAGE soft tokens per image, instead of Gemma 3's 896 pixels and 256 tokens.
TINY_GEMMA3_IMAGE_SIZE, TINY_GEMMA3_TOKENS_PER_IMAGE = 56, 4


def _build_tiny_gemma3_vl(spec, out_dir, tokenizer, *, hidden_size, num_layers, num_heads, num_kv_heads,
                          intermediate_size, max_position_embeddings, seed) -> Path:
    """A random-init Gemma 3 with images (Gemma3ForConditionalGeneration): a tiny SigLIP vision tower,
    Gemma 3's pooling projector and a tiny Gemma 3 language model of the given shape, with Gemma 3's
    image processor resizing to TINY_GEMMA3_IMAGE_SIZE.

    The processor carries image_seq_length = the config's mm_tokens_per_image, which is what the
    gemma3 vision plugin (registries/multimodal/gemma3.py) writes per image, so the count of soft
    tokens is exactly the number of features the forward scatters."""
    import torch
    import transformers

    from registries.multimodal.gemma3 import BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN

    vision_heads, head_dim = 2, hidden_size // num_heads
    config = transformers.Gemma3Config(
        text_config=_text_config(
            tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, max_position_embeddings,
            head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=64,
        ),
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=vision_heads * 16, intermediate_size=vision_heads * 32,
            num_hidden_layers=num_layers, num_attention_heads=vision_heads, image_size=TINY_GEMMA3_IMAGE_SIZE,
            patch_size=14,
        ),
        mm_tokens_per_image=TINY_GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=tokenizer.convert_tokens_to_ids(BOI_TOKEN),
        eoi_token_index=tokenizer.convert_tokens_to_ids(EOI_TOKEN),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
    )
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, spec.auto_class).from_config(config, dtype=torch.float32)
        # transformers starts Gemma 3's projection at zero (a fine-tune start, not a model): images would
        # reach the language model as zeros, so a random model gets a random projection instead.
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        torch.nn.init.normal_(projection, std=config.initializer_range)
    out = _save(model, tokenizer, out_dir)
    # Gemma 3's genuine processor (resize to a square, mean/std 0.5) at the tiny size; the PIL backend
    # by name, because torchvision is not installed.
    size = TINY_GEMMA3_IMAGE_SIZE
    transformers.Gemma3ImageProcessorPil(
        size={"height": size, "width": size}, image_seq_length=TINY_GEMMA3_TOKENS_PER_IMAGE
    ).save_pretrained(out)
    return out


# Captured once: the cache key must not depend on what the module attribute points to later.
_BUILD_SIGNATURE = inspect.signature(build_tiny_model)


def tiny_model_path(family: str, **kwargs) -> Path:
    """A cached tiny model folder: built on first use, reused after.

    The cache is ``$RAYFACTORY_CACHE/tiny`` (default ``~/.cache/rayfactory/tiny``), one folder
    per family and argument set. A build goes to a temporary folder that is renamed into
    place, so a folder that exists is complete, and two processes racing just both finish.
    """
    corpus = kwargs.pop("corpus", None)
    if corpus is not None:
        corpus = list(corpus)  # hashed and then trained on, so it is read once
    get_model_family(family)  # unknown names fail here, before anything is written
    final = cache_root() / "tiny" / f"{family}-{_build_key(family, kwargs, corpus)}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_tiny_model(family, staging, corpus=corpus, **kwargs)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        publish_folder(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def cache_root() -> Path:
    override = os.environ.get("RAYFACTORY_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "rayfactory"


def publish_folder(staging: Path, final: Path) -> None:
    """Move a finished build into place; if another builder got there first, keep theirs."""
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():  # not a lost race: a real failure (permissions, disk)
            raise


def _build_key(family: str, kwargs: dict, corpus: list[str] | None) -> str:
    """Hash of everything that decides the build; defaults filled in, so spelling out a
    default (``seed=0``) finds the same folder as leaving it out."""
    bound = _BUILD_SIGNATURE.bind(family, "", corpus=corpus, **kwargs)
    bound.apply_defaults()
    args = {k: v for k, v in bound.arguments.items() if k not in ("family", "out_dir", "corpus")}
    described = {"family": family, "version": BUILD_VERSION, "args": args, "corpus": corpus}
    text = json.dumps(described, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
