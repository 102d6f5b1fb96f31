"""Image preprocessing at scale: a few hundred generated pictures of varied sizes, decoded and
resized by Ray Data tasks, give exactly the driver's rows, and image_max_pixels / image_min_pixels
decide every picture's patch grid (benchmarks/vision_data.py times the same on thousands)."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest
import ray

from cluster.config import load_config
from fabric.data.prepare import prepare_datasets
from registries.synthetic import shapes
from stages.loading import load_tokenizer_and_template
from tests.e2e.conftest import tiny_sft_config

pytestmark = pytest.mark.ray

PICTURES = 300  # 600 rows: two tokenizing windows of 512 rows (fabric/data/common.py BATCH_SIZE)
MIN_PIXELS, MAX_PIXELS = 84 * 84, 112 * 112
# Patches per side, per picture side. The resize to the limits keeps the aspect (square here):
# 32, 48 and 64 grow to 84 pixels (6 patches of 14), 128..512 shrink to 112 (8 patches). With
# LLaMA-Factory's default limits they would be 4, 4, 4, 10, 18 and 36.
GRID_SIDE = {32: 6, 48: 6, 64: 6, 128: 8, 256: 8, 512: 8}
PATCH_VALUES = 3 * 2 * 14 * 14  # channels x temporal patch x 14 x 14 per Qwen2-VL patch


def tokenized_table(data_dir, engine: str, tmp_path):
    config = tiny_sft_config(
        tmp_path / engine, model_name_or_path="tiny:qwen2_vl", template="qwen2_vl", dataset=shapes.MANY,
        dataset_dir=str(data_dir), cutoff_len=128, image_min_pixels=MIN_PIXELS, image_max_pixels=MAX_PIXELS,
        preprocessing_engine=engine,
    )
    cfg = load_config(config)
    tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
    data = prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, tokenizer, template)
    return data.train, tokenizer


def test_ray_data_rows_equal_the_drivers_across_tasks_and_honour_the_pixel_limits(ray_session, tmp_path):
    data_dir = tmp_path / "data"
    shapes.write_many(str(data_dir), PICTURES)
    pictures = shapes.many_pictures(PICTURES)
    assert {p.size for p in pictures} == set(GRID_SIDE)

    by_driver, tokenizer = tokenized_table(data_dir, "driver", tmp_path)
    by_ray_data, _ = tokenized_table(data_dir, "ray_data", tmp_path)

    # The work was spread: one Ray Data task per window of 512 rows, and more than one block.
    tasks = re.search(r"MapBatches\(_tokenize_block\): (\d+) tasks executed", by_ray_data.stats())
    assert tasks and int(tasks.group(1)) == 2, by_ray_data.stats()
    assert by_ray_data.num_blocks() >= 2

    driver = pa.concat_tables(ray.get(by_driver.to_arrow_refs()))
    ray_data = pa.concat_tables(ray.get(by_ray_data.to_arrow_refs()))
    assert driver.num_rows == ray_data.num_rows == 2 * PICTURES  # no row dropped or added
    assert driver.column_names == ray_data.column_names
    for name in ("input_ids", "attention_mask", "labels", "image_grid_thw"):
        assert driver[name].to_pylist() == ray_data[name].to_pylist(), name
    # The patches as bytes, and where each row's patches start and end
    patches, ray_data_patches = driver["pixel_values"].combine_chunks(), ray_data["pixel_values"].combine_chunks()
    assert patches.offsets.equals(ray_data_patches.offsets)
    assert np.asarray(patches.values).tobytes() == np.asarray(ray_data_patches.values).tobytes()

    # Rows keep the file's order: row i asks about picture i // 2, whose size decides its grid.
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    offsets = patches.offsets.to_pylist()
    for i, row in enumerate(driver.select(["input_ids", "image_grid_thw"]).to_pylist()):
        [(_, height, width)] = row["image_grid_thw"]
        assert MIN_PIXELS <= (14 * height) * (14 * width) <= MAX_PIXELS, (i, pictures[i // 2])
        side = GRID_SIDE[pictures[i // 2].size]
        assert row["image_grid_thw"] == [[1, side, side]], (i, pictures[i // 2])
        assert row["input_ids"].count(pad) == side * side // 4  # 2x2 patches merge into one token
        assert offsets[i + 1] - offsets[i] == side * side * PATCH_VALUES
