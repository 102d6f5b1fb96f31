"""The data preview: a dataset's rows as the chosen stage and template tokenize them.

Every number comes from the registries' own path (``StageSpec.tokenize_here``: the aligner, the
template, the stage's label masking), so what the page colours as trained is what the run trains
on. Rows are shown unpacked: packing only concatenates them, it changes no label.

A row with images also gets them, in ``images`` (one list per shown row, [] for a text row), as
small PNG thumbnails embedded as data URLs: the page needs no file endpoint, so there is no
route by which a request could name a file. Only files inside the config's dataset_dir are read
(a row may name any path; the web UI shows none outside its data), each size-checked before it is
decoded.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
from typing import Any

from registries.tokenize import IGNORE_INDEX

SHOWN_ROWS = 3
LENGTH_ROWS = 5000  # rows measured for the histogram (the first ones; the page says when capped)
BINS = 20
# Column pairs a stage's tokenized example holds: (ids, labels, what the page calls the sequence).
SEQUENCES = (
    ("input_ids", "labels", "example"),
    ("chosen_input_ids", "chosen_labels", "chosen"),
    ("rejected_input_ids", "rejected_labels", "rejected"),
    ("kl_input_ids", "kl_labels", "mismatched pair (KL)"),
)
THUMBNAIL_SIDE = 256  # the longer side of a thumbnail, in pixels (smaller pictures keep their size)
IMAGES_PER_ROW = 4  # more are counted, not shown: the preview JSON stays small
MAX_IMAGE_BYTES = 32 * 2**20  # files larger than this are not decoded for a preview
MAX_IMAGE_PIXELS = 50_000_000  # nor pictures whose header claims more pixels (decompression bombs)


def preview(config: dict[str, Any], dataset: str, rows: int = SHOWN_ROWS) -> dict[str, Any]:
    """The first ``rows`` examples of ``dataset`` as tokens with their label mask, and the token
    lengths of its first LENGTH_ROWS examples against cutoff_len."""
    from ..config import load_config
    from ..driver import tokenizer_and_template

    cfg = load_config(dict(config), purpose="check")  # previewing runs none of the config's modules
    tokenizer, template = tokenizer_and_template(cfg)
    stage = cfg.job_spec().stage
    one = dataclasses.replace(cfg.data, dataset=[dataset], packing=False, neat_packing=False, streaming=False)
    shown_args = dataclasses.replace(one, max_samples=rows)
    shown = stage.tokenize_here(tokenizer, template, shown_args)
    measured = stage.tokenize_here(
        tokenizer, template, dataclasses.replace(one, max_samples=LENGTH_ROWS, cutoff_len=10**9))
    lengths = [_length(example) for example in measured]
    cutoff = cfg.data.cutoff_len
    return {
        "dataset": dataset,
        "stage": stage.name,
        "template": template.name,
        "rows": [_sequences(example, tokenizer) for example in shown],
        "images": shown_images(stage, tokenizer, template, shown_args, len(shown)),
        "count": len(lengths),
        "capped": len(lengths) == LENGTH_ROWS,
        "cutoff_len": cutoff,
        "truncated": sum(length > cutoff for length in lengths),
        "histogram": histogram(lengths, cutoff),
    }


def _length(example: dict[str, Any]) -> int:
    """The longest sequence an example puts through the model (a pair: its longer side)."""
    return max(len(example[ids]) for ids, _, _ in SEQUENCES if ids in example)


def _sequences(example: dict[str, Any], tokenizer) -> list[dict[str, Any]]:
    out = []
    for ids_key, labels_key, name in SEQUENCES:
        if ids_key not in example:
            continue
        ids, labels = example[ids_key], example.get(labels_key) or [IGNORE_INDEX] * len(example[ids_key])
        out.append({
            "name": name,
            "tokens": [
                {"id": int(i), "text": tokenizer.decode([i]), "trained": label != IGNORE_INDEX}
                for i, label in zip(ids, labels)
            ],
        })
    return out


def histogram(lengths: list[int], cutoff: int, bins: int = BINS) -> dict[str, Any]:
    """Equal-width bins from 0 to max(longest, cutoff), so the cutoff line always falls inside."""
    top = max([cutoff, *lengths]) if lengths else cutoff
    width = max(1, -(-top // bins))  # ceil, at least one token per bin
    counts = [0] * bins
    for length in lengths:
        counts[min(length // width, bins - 1)] += 1
    return {"width": width, "counts": counts}


def shown_images(stage, tokenizer, template, data_args, shown: int) -> list[list[dict[str, Any]]]:
    """The thumbnails of each shown example's row, in order. The stage may skip a row (one too long
    for cutoff_len): then each row is tokenized alone to learn which ones made it, and where that
    still cannot pair rows with examples no row gets pictures rather than another row's."""
    from registries.datasets import load_aligned

    rows = load_aligned(data_args, stage.name, stage.dataset_need).train
    if not any(row.get("_images") for row in rows):
        return [[] for _ in range(shown)]
    if len(rows) != shown:
        preprocess = stage.preprocess_fn(tokenizer, template, data_args)
        rows = [row for row in rows if _examples_of(preprocess, row)]
        if len(rows) != shown:
            return [[] for _ in range(shown)]
    root = os.path.realpath(data_args.dataset_dir or ".")
    return [_row_thumbnails(row.get("_images") or [], root) for row in rows]


def _examples_of(preprocess, row: dict[str, Any]) -> int:
    columns = preprocess({key: [value] for key, value in row.items()})
    return len(next(iter(columns.values()), []))


def _row_thumbnails(paths: list[str], root: str) -> list[dict[str, Any]]:
    out = [thumbnail(path, root) for path in paths[:IMAGES_PER_ROW]]
    if len(paths) > IMAGES_PER_ROW:
        out.append({"name": f"{len(paths) - IMAGES_PER_ROW} more image(s)", "error": "not shown in the preview"})
    return out


def thumbnail(path: str, root: str) -> dict[str, Any]:
    """``path`` as {"name", "width", "height", "data_url"} (a PNG at most THUMBNAIL_SIDE a side), or
    {"name", "error"} when it lies outside ``root`` (symlinks followed), is too large or is no picture."""
    from PIL import Image

    name = os.path.basename(path)
    real = os.path.realpath(path)
    if not real.startswith(root.rstrip(os.sep) + os.sep):
        return {"name": name, "error": "outside dataset_dir: not shown"}
    try:
        if os.path.getsize(real) > MAX_IMAGE_BYTES:
            return {"name": name, "error": f"larger than {MAX_IMAGE_BYTES // 2**20} MiB: not shown"}
        with Image.open(real) as image:  # reads the header only; pixels are decoded below
            if image.width * image.height > MAX_IMAGE_PIXELS:
                return {"name": name, "error": f"{image.width}x{image.height} pixels: too large to show"}
            image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
            picture = image.convert("RGBA" if "A" in image.getbands() else "RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        return {"name": name, "error": f"cannot be read as a picture ({type(exc).__name__})"}
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG")
    data = base64.b64encode(encoded.getvalue()).decode("ascii")
    return {"name": name, "width": picture.width, "height": picture.height, "data_url": f"data:image/png;base64,{data}"}
