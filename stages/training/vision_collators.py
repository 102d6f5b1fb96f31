"""The collator of image rows (registries/tokenize/vision.py) for a vision-language model.

Text columns pad as for any sft batch (on the right: Qwen2-VL's multimodal positions are computed
from the ids and the mask, so rows are never laid end to end). The image columns are joined
across the batch the way Qwen2-VL's forward takes them:

    pixel_values    (sum over the batch's images of t*h*w, patch values)  every image's patches, in row order
    image_grid_thw  (number of images, 3)                                 one (t, h, w) per image, in the same order
    mm_token_type_ids (B, L)                                              1 on image tokens, 0 elsewhere

A batch whose rows have no image gets neither image tensor (the model then reads text only).
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
    return VisionCollator(text=text, image_token_id=int(image_token_id))
