"""The ``images`` column: LLaMA-Factory's multimodal rows read, paths resolved, bad rows named."""

import json
import os

import pytest

from registries.datasets import DatasetRowError, align_batch, aligned_table, align_rows, get_dataset_attrs, read_rows

SHAREGPT_MM = {"formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
               "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}
ALPACA_MM = {"columns": {"prompt": "instruction", "query": "input", "response": "output", "images": "images"}}


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "pics").mkdir(parents=True)
    for name in ("a.png", "b.png"):
        (tmp_path / "data" / "pics" / name).write_bytes(b"not decoded while aligning")
    return tmp_path / "data"


def align(data_dir, rows, entry):
    (data_dir / "my.json").write_text(json.dumps(rows), encoding="utf-8")
    (data_dir / "dataset_info.json").write_text(json.dumps({"my": {"file_name": "my.json", **entry}}))
    [attr] = get_dataset_attrs(["my"], "data")
    return attr, align_rows(read_rows(attr), attr)


def convo(*texts):
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


def test_sharegpt_images_resolved_against_dataset_dir(data_dir):
    row = {"messages": convo("<image>What colour?", "red"), "images": ["pics/a.png"]}
    _, result = align(data_dir, [row], SHAREGPT_MM)
    ex = result.examples[0]
    assert ex["_images"] == [os.path.join("data", "pics/a.png")]
    assert ex["_prompt"] == [{"role": "user", "content": "<image>What colour?"}]
    assert ex["_response"] == [{"role": "assistant", "content": "red"}]


def test_alpaca_two_images_in_order_and_string_value(data_dir):
    rows = [
        {"instruction": "<image><image>Same shape?", "output": "yes", "images": ["pics/b.png", "pics/a.png"]},
        {"instruction": "<image>Shape?", "output": "circle", "images": "pics/a.png"},
    ]
    _, result = align(data_dir, rows, ALPACA_MM)
    assert [ex["_images"] for ex in result.examples] == [
        ["data/pics/b.png", "data/pics/a.png"],
        ["data/pics/a.png"],
    ]


def test_path_relative_to_working_dir_when_not_in_dataset_dir(data_dir):
    # LLaMA-Factory keeps a path as given when dataset_dir/path is not a file.
    row = {"instruction": "<image>?", "output": "x", "images": ["data/pics/a.png"]}
    _, result = align(data_dir, [row], ALPACA_MM)
    assert result.examples[0]["_images"] == ["data/pics/a.png"]


def test_text_row_of_image_dataset_has_empty_list(data_dir):
    _, result = align(data_dir, [{"instruction": "hi", "output": "yo"}], ALPACA_MM)
    assert result.examples[0]["_images"] == []


def test_text_dataset_has_no_images_key(data_dir):
    _, result = align(data_dir, [{"instruction": "hi", "output": "yo"}], {})
    assert "_images" not in result.examples[0]


def test_url_refused_with_file_row_field(data_dir):
    row = {"instruction": "<image>?", "output": "x", "images": ["https://example.com/cat.png"]}
    with pytest.raises(DatasetRowError) as info:
        align(data_dir, [{"instruction": "q", "output": "a"}, row], ALPACA_MM)
    err = info.value
    assert (err.row, err.file, err.field) == (2, "data/my.json", "images[0]")
    assert str(err).startswith("row 2 of data/my.json (dataset 'my'): image 'https://example.com/cat.png' is a URL")
    assert "offline" in str(err) and "\n" not in str(err)


def test_missing_file_named(data_dir):
    row = {"messages": convo("<image>?", "x"), "images": ["pics/gone.png"]}
    with pytest.raises(DatasetRowError) as info:
        align(data_dir, [row], SHAREGPT_MM)
    assert info.value.field == "images[0]"
    assert "image file 'pics/gone.png' does not exist (looked for 'data/pics/gone.png' and 'pics/gone.png')" in str(
        info.value
    )


def test_placeholder_count_must_match(data_dir):
    row = {"messages": convo("What colour?", "red"), "images": ["pics/a.png"]}
    with pytest.raises(DatasetRowError, match=r"1 image\(s\) in column 'images' but 0 <image> placeholder"):
        align(data_dir, [row], SHAREGPT_MM)


def test_non_string_item_rejected(data_dir):
    row = {"instruction": "<image>?", "output": "x", "images": [3]}
    with pytest.raises(DatasetRowError, match=r"image images\[0\] is 3, expected a file path"):
        align(data_dir, [row], ALPACA_MM)


def test_batch_and_arrow_table_carry_images(data_dir):
    attr, _ = align(data_dir, [{"instruction": "<image>?", "output": "x", "images": ["pics/a.png"]}], ALPACA_MM)
    rows = read_rows(attr)
    batch = align_batch({k: [r[k] for r in rows] for k in rows[0]}, attr)
    table = aligned_table(batch)
    assert table.column("_images").to_pylist() == [["data/pics/a.png"]]
