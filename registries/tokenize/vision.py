"""Image rows for the supervised and pairwise kinds: each ``<image>`` expanded into the family's vision tokens
(the template's vision plugin, registries/multimodal) and the images decoded, resized and turned
into the processor's tensors, inside the same batch function that tokenizes the text, so Ray Data
spreads the decoding over the cluster.

What a tokenized image row carries besides its ids (two columns, present exactly when the
aligned batch has an ``_images`` column; a text row in such a batch has empty cells):

    pixel_values    float32 array     the processor's patches of every image of the row, flattened
                                      (Qwen2-VL: sum(t*h*w) patches of 3*2*14*14 values)
    image_grid_thw  list[[t, h, w]]   one per image, in order

The patches stay float32 numpy arrays, never Python floats (~32 bytes each where the value takes
4: a Ray Data worker held ~5x its window's patches that way), and ``image_columns`` turns a
window's columns into Arrow arrays of fixed types (pixel_values ``list<float32>``, image_grid_thw
``list<list<int64>>``) without a per-value copy: every block, whether its rows have images or
not (a text dataset mixed in), then has the same schema, and the cast back to float32 in the
collator is exact.

A preference pair (pairwise.py) carries its images once, for the prompt both answers share; the
collator counts them for each half of the pair.

The collator (stages/training/vision_collators.py) concatenates them across the batch, as
Qwen2-VL's forward takes them. Patches travel flattened rather than as decoded pictures: they are
what the model reads, and the processor's resize and normalisation then run once per row here,
not once per epoch in every training worker.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from registries.errors import UserError

from .common import Batch

IMAGES = "_images"
PIXEL_VALUES, IMAGE_GRID_THW = "pixel_values", "image_grid_thw"
IMAGE_CUT = (
    "its image tokens do not fit in cutoff_len (an image cannot be cut: raise cutoff_len, or lower "
    "image_max_pixels so each image has fewer tokens)"
)


def has_image_column(batch: Batch) -> bool:
    return batch.get(IMAGES) is not None


def row_image_paths(batch: Batch, row: int) -> list[str]:
    cells = batch.get(IMAGES)
    cell = None if cells is None else cells[row]
    return [] if cell is None else [str(path) for path in cell]


def expand_images(template, messages: list[dict], paths: list[str], data_args) -> tuple[list[dict], dict[str, Any]]:
    """``messages`` with each ``<image>`` expanded into the template's vision tokens, and the
    processor's tensors for ``paths`` (decoded, resized by image_max_pixels / image_min_pixels)."""
    mm = image_inputs(template, paths, data_args)
    return expand_messages(template, messages, mm), mm


def image_inputs(template, paths: list[str], data_args) -> dict[str, Any]:
    """The processor's tensors for ``paths``: decoded once, then any number of message lists that
    share the images (a preference pair's two answers) expand with ``expand_messages``."""
    from registries.multimodal import load_image, vision_plugin_of
    from registries.multimodal.images import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS

    plugin = vision_plugin_of(template)  # a text-only template: a UserError that names a vision one
    processor = _image_processor(template)
    max_pixels = getattr(data_args, "image_max_pixels", None) or DEFAULT_MAX_PIXELS  # data args without them: LF defaults
    min_pixels = getattr(data_args, "image_min_pixels", None) or DEFAULT_MIN_PIXELS
    return plugin.inputs([load_image(path) for path in paths], processor, max_pixels, min_pixels)


def expand_messages(template, messages: list[dict], mm: dict[str, Any]) -> list[dict]:
    """``messages`` with each ``<image>`` expanded into the vision tokens of ``mm``'s images."""
    from registries.multimodal import vision_plugin_of

    return vision_plugin_of(template).expand(messages, mm, _image_processor(template))


def _image_processor(template):
    processor = getattr(template, "image_processor", None)
    if processor is None:
        raise UserError(
            f"The rows have images, but template {template.name!r} has no image processor: the model folder "
            "has no preprocessor_config.json. Use a vision-language model of that family (e.g. tiny:qwen2_vl "
            "for the qwen2_vl template)."
        )
    return processor


def image_token_id(tokenizer, template) -> int:
    from registries.multimodal import vision_plugin_of

    return tokenizer.convert_tokens_to_ids(vision_plugin_of(template).image_token)


def image_token_total(template, expanded: list[dict]) -> int:
    """How many image tokens the expanded messages hold: the ids must keep every one of them."""
    from registries.multimodal import vision_plugin_of

    token = vision_plugin_of(template).image_token
    return sum(message["content"].count(token) for message in expanded)


def image_cells(mm: dict[str, Any] | None) -> tuple[np.ndarray, list[list[int]]]:
    """The row's two cells (see the module doc); empty for a row without images."""
    if not mm:
        return np.zeros(0, dtype=np.float32), []
    grid = mm.get(IMAGE_GRID_THW)
    # np.asarray shares the processor's float32 tensor's memory: no copy, no rounding.
    return np.asarray(mm[PIXEL_VALUES], dtype=np.float32).reshape(-1), [] if grid is None else grid.tolist()


# Arrow's list offsets are int32: a window whose patches hold more values is cut into chunks.
MAX_LIST_VALUES = 2**31 - 1


def image_columns(columns: dict[str, list[Any]], max_values: int = MAX_LIST_VALUES) -> dict[str, Any]:
    """``columns`` (a tokenize function's output) with its image cells as typed Arrow arrays
    (see the module doc); columns without images are returned as they are."""
    if PIXEL_VALUES not in columns:
        return columns
    import pyarrow as pa

    grids = pa.array(columns[IMAGE_GRID_THW], type=pa.list_(pa.list_(pa.int64())))
    return {**columns, PIXEL_VALUES: pixel_array(columns[PIXEL_VALUES], max_values), IMAGE_GRID_THW: grids}


def pixel_array(cells: list[np.ndarray], max_values: int = MAX_LIST_VALUES):
    """Rows of float32 values -> a ``list<float32>`` ChunkedArray over one concatenated copy of
    them (a chunk per at most ``max_values`` values; one chunk, maybe empty, at least)."""
    import pyarrow as pa

    chunks, start, held = [], 0, 0
    for end, cell in enumerate(cells):
        if len(cell) > max_values:
            raise ValueError(
                f"One row's images have {len(cell)} pixel values, more than an Arrow list holds ({max_values})."
            )
        if held + len(cell) > max_values and end > start:
            chunks.append(_list_chunk(cells[start:end]))
            start, held = end, 0
        held += len(cell)
    chunks.append(_list_chunk(cells[start:]))
    return pa.chunked_array(chunks, type=pa.list_(pa.float32()))


def _list_chunk(cells: list[np.ndarray]):
    import pyarrow as pa

    offsets = np.zeros(len(cells) + 1, dtype=np.int32)
    np.cumsum([len(cell) for cell in cells], out=offsets[1:])
    values = np.concatenate(cells) if cells else np.zeros(0, dtype=np.float32)
    # pa.array over a float32 numpy array wraps its buffer: the values are not copied again.
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.float32()))
