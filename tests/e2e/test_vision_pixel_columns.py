"""Image patches travel as float32 from the processor to the collator: the tokenized rows' pixel_values
column is Arrow ``list<float32>`` (never Python floats, never a Ray tensor type) for sft and dpo rows,
by Ray Data and by the driver, and its bytes are the image processor's own float32 output."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import ray
import torch

from cluster.config import load_config
from fabric.data import cache
from fabric.data.common import tokenized_block
from fabric.data.prepare import prepare_datasets
from registries.datasets import load_aligned
from registries.tokenize.vision import IMAGE_GRID_THW, PIXEL_VALUES, image_cells, image_columns, image_inputs
from stages.loading import load_tokenizer_and_template
from stages.training.vision_collators import join_images
from tests.e2e.conftest import tiny_sft_config

FLOAT32_LISTS = pa.list_(pa.float32())
GRIDS = pa.list_(pa.list_(pa.int64()))


def cells(*lengths: int) -> list[np.ndarray]:
    """Rows of distinct float32 values (row i holds i*1000, i*1000+1, ...), with a non-integer part."""
    return [np.arange(n, dtype=np.float32) + 1000 * i + 0.25 for i, n in enumerate(lengths)]


# ---------------------------------------------------------------------------- the columns (no Ray)

def test_image_columns_are_typed_arrow_arrays_over_the_same_values():
    pixels = cells(3, 0, 2)
    grids = [[[1, 2, 2]], [], [[1, 1, 2]]]
    typed = image_columns({"input_ids": [[1], [2], [3]], PIXEL_VALUES: pixels, IMAGE_GRID_THW: grids})
    column = typed[PIXEL_VALUES]
    assert column.type == FLOAT32_LISTS and typed[IMAGE_GRID_THW].type == GRIDS
    assert column.num_chunks == 1
    assert column.chunk(0).offsets.to_pylist() == [0, 3, 3, 5]
    assert np.asarray(column.chunk(0).values).tobytes() == np.concatenate(pixels).tobytes()
    assert typed["input_ids"] == [[1], [2], [3]]  # the text columns are left as they are
    assert typed[IMAGE_GRID_THW].to_pylist() == grids


def test_a_window_without_any_image_still_has_the_typed_columns():
    typed = image_columns({"input_ids": [[1], [2]], PIXEL_VALUES: cells(0, 0), IMAGE_GRID_THW: [[], []]})
    assert (typed[PIXEL_VALUES].type, typed[IMAGE_GRID_THW].type) == (FLOAT32_LISTS, GRIDS)
    assert typed[PIXEL_VALUES].to_pylist() == [[], []]
    empty = image_columns({"input_ids": [], PIXEL_VALUES: [], IMAGE_GRID_THW: []})
    assert len(empty[PIXEL_VALUES]) == 0 and empty[PIXEL_VALUES].type == FLOAT32_LISTS
    text = {"input_ids": [[1]]}
    assert image_columns(text) is text and tokenized_block(text) is text  # a text stage's block: as before


def test_a_window_past_the_offsets_limit_is_cut_into_chunks_row_by_row():
    pixels = cells(4, 3, 2, 5, 1)
    column = image_columns({PIXEL_VALUES: pixels, IMAGE_GRID_THW: [[]] * 5}, max_values=7)[PIXEL_VALUES]
    assert [chunk.offsets.to_pylist() for chunk in column.chunks] == [[0, 4, 7], [0, 2, 7], [0, 1]]
    assert [np.asarray(row, dtype=np.float32).tobytes() for row in column.to_numpy(zero_copy_only=False)] == [
        p.tobytes() for p in pixels]
    with pytest.raises(ValueError, match="more than an Arrow list holds"):
        image_columns({PIXEL_VALUES: cells(8), IMAGE_GRID_THW: [[]]}, max_values=7)


def test_tables_with_and_without_images_concatenate_into_one_schema():
    with_images = tokenized_block({"input_ids": [[1]], PIXEL_VALUES: cells(2), IMAGE_GRID_THW: [[[1, 1, 2]]]})
    text_rows = tokenized_block({"input_ids": [[2]], PIXEL_VALUES: cells(0), IMAGE_GRID_THW: [[]]})
    assert with_images.schema == text_rows.schema
    assert pa.concat_tables([with_images, text_rows])[PIXEL_VALUES].to_pylist() == [[0.25, 1.25], []]


def test_image_cells_share_the_processors_float32_values():
    patches = torch.randn(4, 6)
    pixels, grid = image_cells({PIXEL_VALUES: patches, IMAGE_GRID_THW: torch.tensor([[1, 2, 2]])})
    assert pixels.dtype == np.float32 and pixels.tobytes() == patches.numpy().tobytes()
    assert grid == [[1, 2, 2]]
    empty, no_grid = image_cells(None)
    assert empty.dtype == np.float32 and len(empty) == 0 and no_grid == []


# ---------------------------------------------------------------------------- rows from both engines (Ray)

CASES = {
    "sft": dict(stage="sft", dataset="shapes_train", max_samples=24),
    "dpo": dict(stage="dpo", dataset="shapes_pref", max_samples=24),
}


def prepared(tmp_path, case: str, engine: str):
    cfg = load_config(tiny_sft_config(
        tmp_path / f"{case}-{engine}", model_name_or_path="tiny:qwen2_vl", template="qwen2_vl", cutoff_len=64,
        preprocessing_engine=engine, **CASES[case]))
    tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
    data = prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, tokenizer, template)
    return cfg, template, pa.concat_tables(ray.get(data.train.to_arrow_refs()))


@pytest.mark.ray
@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_hold_the_processors_float32_patches_as_list_float32(ray_session, tmp_path, case):
    cfg, template, by_ray_data = prepared(tmp_path, case, "ray_data")
    _, _, by_driver = prepared(tmp_path, case, "driver")
    assert by_ray_data.schema.field(PIXEL_VALUES).type == by_driver.schema.field(PIXEL_VALUES).type == FLOAT32_LISTS
    assert by_ray_data.schema.field(IMAGE_GRID_THW).type == by_driver.schema.field(IMAGE_GRID_THW).type == GRIDS

    # Every row kept (no cutoff here), in file order: row i's patches are its images' processor output.
    spec = cfg.finetuning.spec
    aligned = load_aligned(cfg.data, spec.name, spec.dataset_need, cfg.training.seed).train
    assert by_ray_data.num_rows == by_driver.num_rows == len(aligned) == 24
    expected = [image_inputs(template, row["_images"], cfg.data) for row in aligned]
    for table in (by_ray_data, by_driver):
        column = table[PIXEL_VALUES].combine_chunks()
        offsets = column.offsets.to_numpy()
        values = np.asarray(column.values)
        assert values.dtype == np.float32
        for i, mm in enumerate(expected):
            assert mm[PIXEL_VALUES].dtype == torch.float32
            assert values[offsets[i]:offsets[i + 1]].tobytes() == mm[PIXEL_VALUES].numpy().tobytes(), i
        assert table[IMAGE_GRID_THW].to_pylist() == [mm[IMAGE_GRID_THW].tolist() for mm in expected]

    # The collator's tensors (from a Ray Data numpy batch, as the train workers get them) are the processor's.
    batch = ray.data.from_arrow(by_ray_data).take_batch(8, batch_format="numpy")
    patches, grids = join_images(list(batch[PIXEL_VALUES]), list(batch[IMAGE_GRID_THW]))
    assert torch.equal(patches, torch.cat([mm[PIXEL_VALUES] for mm in expected[:8]]))
    assert torch.equal(grids, torch.cat([mm[IMAGE_GRID_THW] for mm in expected[:8]]))


@pytest.mark.ray
def test_the_tokenized_path_cache_keeps_the_float32_patches(ray_session, tmp_path):
    config = tiny_sft_config(
        tmp_path / "out", model_name_or_path="tiny:qwen2_vl", template="qwen2_vl", cutoff_len=64,
        preprocessing_engine="ray_data", tokenized_path=str(tmp_path / "cache"), **CASES["sft"])
    cfg = load_config(config)
    tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
    first = prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, tokenizer, template)
    assert cache.reusable(cfg.data)  # the second call loads the saved parquet files
    again = prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, tokenizer, template)
    made, reused = (pa.concat_tables(ray.get(d.train.to_arrow_refs())) for d in (first, again))
    assert reused.schema.field(PIXEL_VALUES).type == FLOAT32_LISTS
    assert made.num_rows == reused.num_rows == 24
    assert made[PIXEL_VALUES].combine_chunks().equals(reused[PIXEL_VALUES].combine_chunks())
    assert made[IMAGE_GRID_THW].to_pylist() == reused[IMAGE_GRID_THW].to_pylist()
