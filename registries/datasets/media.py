"""The ``images`` column of a multimodal row: a list of image files, checked while aligning.

LLaMA-Factory's conventions, kept so its multimodal datasets work as they are:

* the column holds a list of paths (a single string is read as a one-item list);
* a relative path is looked up inside ``dataset_dir`` first and, if no file is there, as given
  (relative to the working directory), the order LLaMA-Factory's converter uses;
* the text marks where each image goes with an ``<image>`` placeholder, one per image, in
  order; the vision plugin of the template later expands each into the model's tokens.

Differences on purpose: LLaMA-Factory only warns about a missing file and fails later inside
the image processor, and it fetches http(s) URLs. We check every file while aligning, so a bad
row is named by file, row and field before any tokenizing, and we refuse URLs: training runs
offline and a download in the middle of preprocessing would make results depend on the network.
"""

from __future__ import annotations

import os
from typing import Any

from .rowcontext import RowContext

IMAGE_PLACEHOLDER = "<image>"
_URL_PREFIXES = ("http://", "https://")


def read_images(ctx: RowContext) -> list[str]:
    """The row's image paths, resolved and checked; [] if the row has none."""
    column = ctx.attr.column("images")
    if column is None:
        return []
    value = ctx.value(column, required=False)
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, str) and value.strip()[:1] == "[":  # csv / parquet cells may hold JSON text
        value = ctx.structured(column, value, list, "a list of image paths")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        ctx.fail(column, f"column {column!r} is not a list of image paths")
    return [_resolve(ctx, f"{column}[{i}]", item) for i, item in enumerate(items)]


def _resolve(ctx: RowContext, where: str, item: Any) -> str:
    if not isinstance(item, str) or not item:
        ctx.fail(where, f"image {where} is {item!r}, expected a file path (string)")
    if item.lower().startswith(_URL_PREFIXES):
        ctx.fail(
            where,
            f"image {item!r} is a URL; RayFactory works offline and does not download images. "
            f"Download it into the dataset_dir ({ctx.attr.dataset_dir or '.'}) and give its relative path",
        )
    if os.path.isabs(item):
        candidates = [item]
    else:
        candidates = [os.path.join(ctx.attr.dataset_dir, item), item]
    for path in candidates:
        if os.path.isfile(path):
            return path
    looked = " and ".join(repr(p) for p in dict.fromkeys(candidates))
    ctx.fail(where, f"image file {item!r} does not exist (looked for {looked})")


def check_placeholders(ctx: RowContext, messages: list[dict[str, str]], images: list[str]) -> None:
    """One ``<image>`` per image: LLaMA-Factory's plugins raise on a mismatch at tokenizing time,
    we say it here where the row can still be named."""
    count = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if count != len(images):
        column = ctx.attr.column("images") or "images"
        ctx.fail(
            column,
            f"the row has {len(images)} image(s) in column {column!r} but {count} {IMAGE_PLACEHOLDER} "
            f"placeholder(s) in its text; put one {IMAGE_PLACEHOLDER} where each image goes, in order",
        )
