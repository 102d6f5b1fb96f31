"""The shapes demo set: pictures of one coloured shape, drawn with PIL, and questions about them.

``python -m registries.synthetic.shapes [--out data]`` writes ``shapes/*.png``, the train and
held-out sets (sharegpt, LLaMA-Factory's multimodal layout: a ``messages`` list with an
``<image>`` placeholder and an ``images`` list of paths relative to dataset_dir) and merges
their entries into ``dataset_info.json``.

``python -m registries.synthetic.shapes --out DIR --count N`` writes instead one large set,
``shapes_many`` (``write_many``): N pictures drawn at several sizes (MANY_SIZES, 32 to 512 pixels a
side), so image_max_pixels / image_min_pixels really resize some of them down and some up; for
preprocessing at scale (benchmarks/vision_data.py), not for the demo's data/.

The preference sets ``shapes_pref`` and ``shapes_pref_eval`` (LLaMA-Factory's sharegpt ranking
layout with ``images``: ``messages``, a ``chosen`` and a ``rejected`` answer) ask the same questions
about the same pictures as ``shapes_train`` and ``shapes_eval``, the right answer chosen and a
wrong one (another colour or shape, drawn from a seeded stream) rejected.

Every (colour, shape) pair appears in both splits, but each picture is its own draw of size and
position from a seeded stream, so the held-out set asks about pictures never trained on. The
answer is one word, so accuracy is an exact match; a model that cannot see the picture is at
chance (1/4 for colour, 1/3 for shape).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass

SEED = 20261205
SIZE = 64  # pixels per side: small enough for tiny models, large enough for Qwen2-VL's 28-pixel minimum
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "<image>What colour is the shape?", "shape": "<image>What shape is in the picture?"}
IMAGE_DIR = "shapes"
TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
SPLITS = {"shapes_train": 8, "shapes_eval": 2}  # pictures per (colour, shape) pair
PREF_SPLITS = {"shapes_pref": "shapes_train", "shapes_pref_eval": "shapes_eval"}  # the pictures they ask about
MANY = "shapes_many"  # write_many's dataset name
MANY_SIZES = (32, 48, 64, 128, 256, 512)  # pixels per side of write_many's pictures, one drawn per picture


@dataclass(frozen=True)
class Picture:
    file_name: str  # relative to dataset_dir
    colour: str
    shape: str
    box: tuple[int, int, int, int]  # left, top, right, bottom
    size: int = SIZE  # pixels per side of the (square) picture


def plan(split: str, per_pair: int, seed: int = SEED, sizes: tuple[int, ...] = (SIZE,)) -> list[Picture]:
    """The pictures of one split; a str seed per split keeps splits independent and stable.

    With several ``sizes`` each picture draws its own from the same stream; with one, nothing is
    drawn for it, so the demo splits' streams (and pictures) stay what they always were."""
    rng = random.Random(f"{seed}:{split}")
    pictures = []
    for colour in COLOURS:
        for shape in SHAPES:
            for _ in range(per_pair):
                size = rng.choice(sizes) if len(sizes) > 1 else sizes[0]
                # the shape's side and margin scale with the picture: 20..44 and 2 pixels at 64
                side = rng.randint(size * 20 // SIZE, size * 44 // SIZE)
                margin = max(1, size * 2 // SIZE)
                left, top = rng.randint(margin, size - side - margin), rng.randint(margin, size - side - margin)
                name = f"{IMAGE_DIR}/{split}_{len(pictures):03d}.png"
                pictures.append(Picture(name, colour, shape, (left, top, left + side, top + side), size))
    return pictures


def draw(picture: Picture):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (picture.size, picture.size), (255, 255, 255))
    pen, fill = ImageDraw.Draw(image), COLOURS[picture.colour]
    left, top, right, bottom = picture.box
    if picture.shape == "circle":
        pen.ellipse(picture.box, fill=fill)
    elif picture.shape == "square":
        pen.rectangle(picture.box, fill=fill)
    else:
        pen.polygon([((left + right) // 2, top), (right, bottom), (left, bottom)], fill=fill)
    return image


def rows(pictures: list[Picture]) -> list[dict]:
    """Two questions per picture: its colour and its shape."""
    out = []
    for p in pictures:
        for kind, question in QUESTIONS.items():
            answer = p.colour if kind == "colour" else p.shape
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            out.append({"messages": messages, "images": [p.file_name]})
    return out


def pref_rows(pictures: list[Picture], split: str, seed: int = SEED) -> list[dict]:
    """``rows`` as preference pairs: the right answer chosen, a wrong one rejected."""
    rng = random.Random(f"{seed}:{split}:wrong")
    out = []
    for row in rows(pictures):
        question, answer = row["messages"]
        choices = list(COLOURS) if answer["content"] in COLOURS else list(SHAPES)
        wrong = rng.choice([c for c in choices if c != answer["content"]])
        out.append({"messages": [question], "chosen": answer, "rejected": {"role": "assistant", "content": wrong},
                    "images": row["images"]})
    return out


def entry(name: str) -> dict:
    if name in PREF_SPLITS:
        return {
            "file_name": f"{name}.json",
            "formatting": "sharegpt",
            "ranking": True,
            "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected", "images": "images"},
            "tags": dict(TAGS),
        }
    return {
        "file_name": f"{name}.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": dict(TAGS),
    }


def write(out_dir: str, seed: int = SEED) -> list[str]:
    """Write pictures, row files and dataset_info.json entries; returns the paths written."""
    written = []
    for name, per_pair in SPLITS.items():
        written += _write_split(out_dir, name, plan(name, per_pair, seed))
    for name, pictures_of in PREF_SPLITS.items():
        path = os.path.join(out_dir, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(pref_rows(plan(pictures_of, SPLITS[pictures_of], seed), name, seed), indent=1) + "\n")
        written.append(path)
        _add_entry(out_dir, name)
    return written


def many_pictures(count: int, seed: int = SEED, sizes: tuple[int, ...] = MANY_SIZES) -> list[Picture]:
    """write_many's pictures: ``plan`` with enough per (colour, shape) pair, cut to ``count`` (for a
    count not a multiple of 12 the cut falls among the last pairs' pictures: they come short)."""
    per_pair = -(-count // (len(COLOURS) * len(SHAPES)))
    return plan(MANY, per_pair, seed, sizes)[:count]


def write_many(out_dir: str, count: int, seed: int = SEED, sizes: tuple[int, ...] = MANY_SIZES) -> list[str]:
    """Write ``count`` pictures of varied sizes as the sft set ``shapes_many`` (two rows per
    picture, as ``rows``) into ``out_dir`` and its dataset_info.json; returns the paths written."""
    return _write_split(out_dir, MANY, many_pictures(count, seed, sizes))


def _write_split(out_dir: str, name: str, pictures: list[Picture]) -> list[str]:
    """The pictures, the row file and the dataset_info.json entry of one sft set."""
    os.makedirs(os.path.join(out_dir, IMAGE_DIR), exist_ok=True)
    written = []
    for p in pictures:
        path = os.path.join(out_dir, p.file_name)
        draw(p).save(path)
        written.append(path)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(rows(pictures), indent=1) + "\n")
    written.append(path)
    _add_entry(out_dir, name)
    return written


def _add_entry(out_dir: str, name: str) -> None:
    """Merge ``name``'s entry into dataset_info.json; entries of other datasets are kept as they are."""
    info_path = os.path.join(out_dir, "dataset_info.json")
    info = {}
    if os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    info[name] = entry(name)
    with open(info_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(info, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registries.synthetic.shapes", description=__doc__)
    parser.add_argument("--out", default="data")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--count", type=int, default=None,
                        help=f"write only {MANY}: this many pictures of sizes {', '.join(map(str, MANY_SIZES))} px")
    args = parser.parse_args(argv)
    if args.count is not None:
        written = write_many(args.out, args.count, args.seed)
    else:
        written = write(args.out, args.seed)
    print(f"wrote {len(written)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
