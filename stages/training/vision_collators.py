"""The collator of image rows (registries/tokenize/vision.py) for a vision-language model.

Text columns pad as for any sft batch (on the right: Qwen2-VL's multimodal positions are computed
from the ids and the mask, so rows are never laid end to end). The image columns are joined
across the batch the way Qwen2-VL's forward takes them:

    pixel_values    (sum over the batch's images of t*h*w, patch values)  every image's patches, in row order
    image_grid_thw  (number of images, 3)                                 one (t, h, w) per image, in the same order
    mm_token_type_ids (B, L)                                              1 on image tokens, 0 elsewhere

A batch whose rows have no image gets neither image tensor (the model then reads text only).

LLaVA-1.5 (``FixedSizeVisionCollator``): the processor crops every image to one square, so there is
no grid and no mm_token_type_ids; pixel_values is (number of images, 3, size, size), in row order,
with size the vision tower's ``image_size``. Gemma 3 crops the same way and also reads

    token_type_ids (B, L)    1 on image (soft) tokens, 0 elsewhere (LLaMA-Factory's _get_gemma3_token_type_ids)

from which its forward lets each image's tokens attend to one another both ways.

dpo's pairs (``VisionPairwiseCollator``): a pair's row carries its images once; the batch is all
chosen sequences, then all rejected (preference_collators.PairwiseCollator), so the images are the
rows' images in row order, then the same again: each image is counted for both halves of its pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from registries.tokenize.vision import IMAGE_GRID_THW, PIXEL_VALUES



@dataclass
class VisionCollator:
    text: Any  # collators.PaddingCollator (right padding); not imported here: collators.py imports this module
    image_token_id: int

    def __call__(self, features) -> dict[str, torch.Tensor]:
        columns = _columns(features)
        pixels = columns.pop(PIXEL_VALUES, None)
        grids = columns.pop(IMAGE_GRID_THW, None)
        batch = self.text.collate_columns(columns)
        joined = join_images(pixels or [], grids or [])
        if joined is not None:
            batch[PIXEL_VALUES], batch[IMAGE_GRID_THW] = joined
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).long()
        return batch


@dataclass
class VisionPairwiseCollator:
    pairs: Any  # preference_collators.PairwiseCollator (padded); not imported here, as for VisionCollator
    image_token_id: int

    def __call__(self, features) -> dict[str, torch.Tensor]:
        columns = _columns(features)
        pixels = columns.pop(PIXEL_VALUES, None) or []
        grids = columns.pop(IMAGE_GRID_THW, None) or []
        batch = self.pairs(columns)
        joined = join_images(pixels + pixels, grids + grids)  # chosen rows' images, then the rejected rows'
        if joined is not None:
            batch[PIXEL_VALUES], batch[IMAGE_GRID_THW] = joined
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).long()
        return batch


def join_images(pixels: list[Any], grids: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's flattened patches and grids -> (all patches, all grids), or None without images."""
    rows = [(np.asarray(p, dtype=np.float32).reshape(-1), _grid_rows(g)) for p, g in zip(pixels, grids)]
    rows = [(p, g) for p, g in rows if len(g)]
    if not rows:
        return None
    grid = torch.as_tensor(np.concatenate([g for _, g in rows]), dtype=torch.long)
    patches = int(grid.prod(dim=-1).sum())
    values = torch.from_numpy(np.concatenate([p for p, _ in rows]))
    if patches == 0 or values.numel() % patches:
        raise ValueError(
            f"Image columns do not agree: {values.numel()} pixel values for {patches} patches (image_grid_thw "
            f"{grid.tolist()}). The data was tokenized with another image processor: delete tokenized_path."
        )
    return values.reshape(patches, -1), grid


def _columns(features) -> dict[str, list[Any]]:
    """Rows (the Trainer's list of dicts) or columns (Ray Data's) in, columns out."""
    if isinstance(features, Mapping):
        return {key: list(values) for key, values in features.items()}
    if not features:
        raise ValueError("Cannot collate an empty batch.")
    return {key: [row[key] for row in features] for key in features[0]}


def _grid_rows(cell: Any) -> np.ndarray:
    # A list of [t, h, w] lists (Hugging Face datasets) or an object array of arrays (Ray Data numpy batches).
    if cell is None or len(cell) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    return np.stack([np.asarray(thw, dtype=np.int64).reshape(3) for thw in cell])


def is_vision_model(model) -> bool:
    """Whether ``model`` (or the base of a PeftModel) reads images: its config has a vision tower."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "vision_config", None) is not None


def vision_collator(text, data_args, model) -> VisionCollator:
    """sft for a vision-language model: ``text`` (a right-padding collator) for the text columns,
    never padding-free or packed, plus the image tensors."""
    image_token_id = _padded_rows_image_token(data_args, model)
    size = fixed_image_size(model)
    if size is not None:
        return FixedSizeVisionCollator(collate_text=text.collate_columns, image_size=size,
                                       token_type_image_id=_token_type_image_id(model, image_token_id))
    return VisionCollator(text=text, image_token_id=image_token_id)


def vision_pairwise_collator(pairs, data_args, model) -> VisionPairwiseCollator:
    """dpo for a vision-language model: ``pairs`` (a padded PairwiseCollator) for the sequences, never
    padding-free, plus each pair's images for both of its sequences."""
    image_token_id = _padded_rows_image_token(data_args, model)
    size = fixed_image_size(model)
    if size is not None:
        return FixedSizeVisionCollator(collate_text=pairs, image_size=size, pairs=True,
                                       token_type_image_id=_token_type_image_id(model, image_token_id))
    return VisionPairwiseCollator(pairs=pairs, image_token_id=image_token_id)


# Families whose processor crops every image to the vision tower's square (LLaVA-1.5's CLIP, Gemma 3's
# SigLIP): their rows carry pixel values without a grid.
FIXED_SIZE_IMAGE_MODEL_TYPES = ("llava", "gemma3")
# Families whose forward reads token_type_ids marking the image tokens (Gemma 3's bidirectional
# attention within each image).
TOKEN_TYPE_IDS_MODEL_TYPES = ("gemma3",)


def _token_type_image_id(model, image_token_id: int) -> int | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    return image_token_id if model_type in TOKEN_TYPE_IDS_MODEL_TYPES else None


def image_token_marks(model, input_ids: torch.Tensor, image_token_id: int) -> dict[str, torch.Tensor]:
    """The tensor marking image tokens that ``model``'s forward reads, as the collators above build
    it, for a caller that builds its own inputs (chat, serve, predict): ``token_type_ids`` (Gemma 3),
    ``mm_token_type_ids`` (the grid families: Qwen2-VL), nothing (LLaVA-1.5)."""
    marks = (input_ids == image_token_id).long()
    if _token_type_image_id(model, image_token_id) is not None:
        return {"token_type_ids": marks}
    if fixed_image_size(model) is None:
        return {"mm_token_type_ids": marks}
    return {}


def fixed_image_size(model) -> int | None:
    """The side of the square crop ``model`` reads every image as, or None for a grid family (Qwen2-VL)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "model_type", None) not in FIXED_SIZE_IMAGE_MODEL_TYPES:
        return None
    return int(config.vision_config.image_size)


@dataclass
class FixedSizeVisionCollator:
    """LLaVA-1.5's and Gemma 3's batches: the text columns padded by ``collate_text`` (a right-padding collator's
    collate_columns, or a PairwiseCollator with ``pairs``), and every row's crops stacked as
    pixel_values (number of images, 3, size, size); a pair's images count for both of its halves."""

    collate_text: Any
    image_size: int
    pairs: bool = False
    token_type_image_id: int | None = None  # set: token_type_ids marks this id (Gemma 3)

    def __call__(self, features) -> dict[str, torch.Tensor]:
        columns = _columns(features)
        pixels = columns.pop(PIXEL_VALUES, None) or []
        columns.pop(IMAGE_GRID_THW, None)  # empty cells: a fixed-size crop has no grid
        batch = self.collate_text(columns)
        joined = join_fixed_size_images(pixels + pixels if self.pairs else pixels, self.image_size)
        if joined is not None:
            batch[PIXEL_VALUES] = joined
        if self.token_type_image_id is not None:
            batch["token_type_ids"] = (batch["input_ids"] == self.token_type_image_id).long()
        return batch


def join_fixed_size_images(pixels: list[Any], image_size: int) -> torch.Tensor | None:
    """Each row's flattened crops -> (all crops, 3, size, size), or None without images."""
    flat = [np.asarray(p, dtype=np.float32).reshape(-1) for p in pixels if p is not None and len(p)]
    if not flat:
        return None
    values = torch.from_numpy(np.concatenate(flat))
    per_image = 3 * image_size * image_size
    if values.numel() % per_image:
        raise ValueError(
            f"Image columns do not agree: {values.numel()} pixel values are no whole number of "
            f"{image_size}x{image_size} crops ({per_image} values each). The data was tokenized with another "
            "image processor: delete tokenized_path."
        )
    return values.reshape(-1, 3, image_size, image_size)


def _padded_rows_image_token(data_args, model) -> int:
    """The model's image token id, once the options that would share rows between examples are off."""
    for option in ("padding_free", "neat_packing", "packing"):
        if getattr(data_args, option, None):
            raise ValueError(
                f"{option} is on, but a vision-language model's batches are padded rows: its multimodal "
                f"positions are computed per row from the image tokens. Set {option}: false (or remove it)."
            )
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    image_token_id = getattr(base.config, "image_token_id", None)
    if image_token_id is None:
        raise ValueError(f"{type(base).__name__}'s config names no image_token_id, so image tokens cannot be found.")
    return int(image_token_id)
