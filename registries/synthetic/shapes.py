"""The shapes demo set: pictures of one coloured shape, drawn with PIL, and questions about them.

``python -m registries.synthetic.shapes [--out data]`` writes ``shapes/*.png``, the train and
held-out sets (sharegpt, LLaMA-Factory's multimodal layout: a ``messages`` list with an
``<image>`` placeholder and an ``images`` list of paths relative to dataset_dir) and merges
their entries into ``dataset_info.json``.

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


@dataclass(frozen=True)
class Picture:
    file_name: str  # relative to dataset_dir
    colour: str
    shape: str
    box: tuple[int, int, int, int]  # left, top, right, bottom


def plan(split: str, per_pair: int, seed: int = SEED) -> list[Picture]:
    """The pictures of one split; a str seed per split keeps splits independent and stable."""
    rng = random.Random(f"{seed}:{split}")
    pictures = []
    for colour in COLOURS:
        for shape in SHAPES:
            for _ in range(per_pair):
                side = rng.randint(20, 44)
                left, top = rng.randint(2, SIZE - side - 2), rng.randint(2, SIZE - side - 2)
                name = f"{IMAGE_DIR}/{split}_{len(pictures):03d}.png"
                pictures.append(Picture(name, colour, shape, (left, top, left + side, top + side)))
    return pictures


def draw(picture: Picture):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
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
    os.makedirs(os.path.join(out_dir, IMAGE_DIR), exist_ok=True)
    written = []
    info_path = os.path.join(out_dir, "dataset_info.json")
    info = json.load(open(info_path, encoding="utf-8")) if os.path.isfile(info_path) else {}
    for name, per_pair in SPLITS.items():
        pictures = plan(name, per_pair, seed)
        for p in pictures:
            path = os.path.join(out_dir, p.file_name)
            draw(p).save(path)
            written.append(path)
        path = os.path.join(out_dir, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(rows(pictures), indent=1) + "\n")
        written.append(path)
        info[name] = entry(name)  # entries of other datasets are kept as they are
    for name, pictures_of in PREF_SPLITS.items():
        path = os.path.join(out_dir, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(pref_rows(plan(pictures_of, SPLITS[pictures_of], seed), name, seed), indent=1) + "\n")
        written.append(path)
        info[name] = entry(name)
    with open(info_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(info, indent=2, ensure_ascii=False) + "\n")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registries.synthetic.shapes", description=__doc__)
    parser.add_argument("--out", default="data")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    print(f"wrote {len(write(args.out, args.seed))} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
