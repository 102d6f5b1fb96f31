"""Does a tiny VLM learn to see? Held-out accuracy on the shapes task, with a control that cannot see.

    .venv/bin/python benchmarks/vision_learning.py                          # 3 seeds, both arms
    .venv/bin/python benchmarks/vision_learning.py --cases vision-42 --steps 48

Each case trains the embedded random-init ``tiny:qwen2_vl`` (full fine-tuning, the vision tower and
projector trained too: a random tower has nothing to keep frozen) through ``run_exp`` on
``shapes_train`` (96 pictures, "What colour is the shape?" / "What shape is in the picture?"), then
answers ``shapes_eval`` (24 pictures never trained on, 48 questions) greedily through ChatModel, as
a user would, and scores exact matches per question kind.

* ``vision-<seed>``: the rows as they are, picture and all.
* ``blind-<seed>``: the control: the same rows with the ``<image>`` placeholder and the pictures
  taken out, trained and judged the same way. Every (colour, shape) pair is equally common, so a
  model that cannot see is at chance: 1/4 on colour, 1/3 on shape, 7/24 overall.

The untrained model's accuracy is printed too (0 here: a random-init model answers gibberish).
Figures, not asserts; tests/e2e/test_vision_learning.py asserts a short version of one seed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness, also when a test loads this file

from harness import REPO_ROOT, bench_main  # noqa: E402 (harness puts the repo root on the path)

from registries.multimodal.registry import IMAGE_PLACEHOLDER  # noqa: E402
from registries.synthetic.shapes import COLOURS, IMAGE_DIR, draw, entry, plan, rows  # noqa: E402

SEEDS = (42, 1, 2)
CASES = {f"{arm}-{seed}": (arm, seed) for arm in ("vision", "blind") for seed in SEEDS}
STEPS = 600
TRAIN_PER_PAIR = 80  # 960 pictures, 1920 questions
MIN_PIXELS = 112 * 112  # the 64-px pictures upscaled to 8 x 8 patches (16 tokens), not 4 x 4 (4 tokens)
COLUMNS = [
    ("case", "case", "{}"), ("steps", "steps", "{}"), ("train wall", "wall_s", "{:.0f} s"),
    ("untrained acc", "before", "{:.3f}"), ("trained acc", "after", "{:.3f}"),
    ("colour acc", "colour", "{:.3f}"), ("shape acc", "shape", "{:.3f}"), ("final loss", "loss", "{:.3f}"),
]


def blind_copy(rows: list[dict]) -> list[dict]:
    """The rows without their pictures: the placeholder goes, so the question is plain text."""
    return [{"messages": [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, "")} for m in row["messages"]]}
            for row in rows]


def write_train_set(arm: str, work: str) -> str:
    """A training set in ``work``: TRAIN_PER_PAIR fresh pictures per (colour, shape) pair, drawn as
    data/shapes_* are (their own seeded stream, so none is a held-out picture), with the two
    questions each; for ``blind``, the same rows without their pictures. Returns the dataset_dir."""
    pictures = plan("vision_learning_train", TRAIN_PER_PAIR)
    os.makedirs(os.path.join(work, IMAGE_DIR), exist_ok=True)
    for picture in pictures:
        draw(picture).save(os.path.join(work, picture.file_name))
    train = rows(pictures) if arm == "vision" else blind_copy(rows(pictures))
    with open(os.path.join(work, "train.json"), "w", encoding="utf-8") as f:
        json.dump(train, f)
    columns = {"messages": "messages", "images": "images"} if arm == "vision" else {"messages": "messages"}
    info = {"train": {**entry("shapes_train"), "file_name": "train.json", "columns": columns}}
    with open(os.path.join(work, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f)
    return work


def training_config(arm: str, seed: int, steps: int, work: str) -> dict:
    return {
        "model_name_or_path": "tiny:qwen2_vl", "template": "qwen2_vl", "stage": "sft", "do_train": True,
        "finetuning_type": "full", "freeze_vision_tower": False, "freeze_multi_modal_projector": False,
        "dataset": "train", "dataset_dir": write_train_set(arm, work), "cutoff_len": 64, "image_min_pixels": MIN_PIXELS,
        "output_dir": os.path.join(work, "out"), "ray_storage_path": os.path.join(work, "ray"),
        "per_device_train_batch_size": 16, "learning_rate": 3.0e-3, "max_steps": steps,
        "lr_scheduler_type": "cosine", "warmup_steps": 10, "logging_steps": 4, "save_strategy": "no",
        "report_to": "none", "seed": seed, "ray_num_workers": 1, "resources_per_worker": {"CPU": 1},
    }


def held_out(arm: str) -> list[tuple[str, list[dict], list[str], str]]:
    """(kind, messages, image paths, answer) per shapes_eval question."""
    data = os.path.join(REPO_ROOT, "data")
    with open(os.path.join(data, "shapes_eval.json"), encoding="utf-8") as f:
        rows = json.load(f)
    out = []
    for row in rows:
        question, answer = row["messages"]
        kind = "colour" if answer["content"] in COLOURS else "shape"
        if arm == "vision":
            out.append((kind, [question], [os.path.join(data, p) for p in row["images"]], answer["content"]))
        else:
            out.append((kind, blind_copy([{"messages": [question]}])[0]["messages"], [], answer["content"]))
    return out


def accuracy(model_path: str, arm: str) -> dict:
    """Greedy exact match on shapes_eval, overall and per question kind."""
    from cluster.api import ChatModel

    chat = ChatModel({"model_name_or_path": model_path, "template": "qwen2_vl", "do_sample": False,
                      "max_new_tokens": 8, "image_min_pixels": MIN_PIXELS})
    hits: dict[str, list[bool]] = {"colour": [], "shape": []}
    try:
        for kind, messages, images, answer in held_out(arm):
            reply = chat.chat(messages, images=images or None)[0].response_text.strip()
            hits[kind].append(reply == answer)
    finally:
        chat.close()
    every = hits["colour"] + hits["shape"]
    return {"acc": sum(every) / len(every), **{k: sum(v) / len(v) for k, v in hits.items()}}


def run_case(name: str, steps: int | None, model_path: str | None = None) -> dict:
    from cluster.driver import run_exp
    from stages.training.callbacks import read_log

    arm, seed = CASES[name]
    with tempfile.TemporaryDirectory(prefix=f"vision-learning-{name}-") as work:
        before = accuracy("tiny:qwen2_vl", arm)["acc"]
        start = time.perf_counter()
        result = run_exp(training_config(arm, seed, steps or STEPS, work))
        wall = time.perf_counter() - start
        after = accuracy(result.output_dir, arm)
        logged = [r for r in read_log(result.output_dir) if "loss" in r]
    return {"case": name, "steps": logged[-1]["current_steps"], "wall_s": wall, "before": before,
            "after": after["acc"], "colour": after["colour"], "shape": after["shape"], "loss": logged[-1]["loss"]}


def main(argv=None) -> int:
    return bench_main(__file__, __doc__, CASES, lambda name: STEPS, run_case, COLUMNS, argv)


if __name__ == "__main__":
    sys.exit(main())
