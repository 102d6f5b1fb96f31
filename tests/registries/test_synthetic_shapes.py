"""The shapes demo set: drawn offline, deterministic, readable as a LLaMA-Factory multimodal dataset."""

import json
from pathlib import Path

from registries.datasets import align_rows, get_dataset_attrs, read_rows
from registries.multimodal import load_image
from registries.synthetic import shapes

DATA = Path(__file__).resolve().parents[2] / "data"


def test_plan_is_deterministic_and_covers_every_pair():
    train = shapes.plan("shapes_train", 8)
    assert train == shapes.plan("shapes_train", 8)
    assert len(train) == 4 * 3 * 8
    assert {(p.colour, p.shape) for p in train} == {(c, s) for c in shapes.COLOURS for s in shapes.SHAPES}


def test_held_out_pictures_are_new_draws():
    train, held = shapes.plan("shapes_train", 8), shapes.plan("shapes_eval", 2)
    assert {(p.colour, p.shape, p.box) for p in held}.isdisjoint({(p.colour, p.shape, p.box) for p in train})


def test_drawn_shape_has_its_colour_at_the_centre():
    for p in shapes.plan("shapes_eval", 2):
        image = shapes.draw(p)
        left, top, right, bottom = p.box
        # the triangle's centroid sits below the box centre; (cx, 2/3 down) is inside every shape
        assert image.getpixel(((left + right) // 2, top + 2 * (bottom - top) // 3)) == shapes.COLOURS[p.colour]
        assert image.getpixel((0, 0)) == (255, 255, 255)


def test_written_set_aligns_with_images(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"other": {"file_name": "o.json"}}))
    shapes.write("data")
    info = json.loads((tmp_path / "data" / "dataset_info.json").read_text())
    assert info["other"] == {"file_name": "o.json"} and info["shapes_eval"] == shapes.entry("shapes_eval")
    [attr] = get_dataset_attrs(["shapes_eval"], "data")
    examples = align_rows(read_rows(attr), attr).examples
    assert len(examples) == 4 * 3 * 2 * 2
    first = examples[0]
    assert first["_prompt"] == [{"role": "user", "content": "<image>What colour is the shape?"}]
    assert first["_response"] == [{"role": "assistant", "content": "red"}]
    assert first["_images"] == ["data/shapes/shapes_eval_000.png"]
    assert load_image(first["_images"][0]).size == (64, 64)


def test_committed_demo_set_matches_the_generator():
    # The repository's data/ holds the generated set; every picture equals a fresh draw.
    for name, per_pair in shapes.SPLITS.items():
        pictures = shapes.plan(name, per_pair)
        assert json.loads((DATA / f"{name}.json").read_text()) == shapes.rows(pictures)
        for p in pictures:
            assert list(load_image(str(DATA / p.file_name)).tobytes()) == list(shapes.draw(p).tobytes())


def test_write_many_draws_pictures_at_varied_sizes(tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"other": {"file_name": "o.json"}}))
    written = shapes.write_many(str(tmp_path), 30, sizes=(32, 128, 512))
    assert len(written) == 30 + 1  # the pictures and the row file
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    assert info == {"other": {"file_name": "o.json"}, "shapes_many": shapes.entry("shapes_many")}
    pictures = shapes.many_pictures(30, sizes=(32, 128, 512))
    assert [p.file_name for p in pictures] == [f"shapes/shapes_many_{i:03d}.png" for i in range(30)]
    assert {p.size for p in pictures} == {32, 128, 512}
    # 3 per (colour, shape) pair planned, cut to 30: yellow squares and triangles are cut off
    assert [(p.colour, p.shape) for p in pictures[-4:]] == [("blue", "triangle")] + [("yellow", "circle")] * 3
    for p in pictures:
        image = load_image(str(tmp_path / p.file_name))
        assert image.size == (p.size, p.size)
        left, top, right, bottom = p.box
        assert 0 < left < right < p.size and 0 < top < bottom < p.size
        assert image.getpixel(((left + right) // 2, top + 2 * (bottom - top) // 3)) == shapes.COLOURS[p.colour]
    [attr] = get_dataset_attrs(["shapes_many"], str(tmp_path))
    examples = align_rows(read_rows(attr), attr).examples
    assert len(examples) == 60
    assert examples[59]["_images"] == [str(tmp_path / "shapes/shapes_many_029.png")]
    assert examples[59]["_response"] == [{"role": "assistant", "content": "circle"}]


def test_many_pictures_are_seeded_and_leave_the_demo_splits_alone():
    assert shapes.many_pictures(50) == shapes.many_pictures(50)
    assert shapes.many_pictures(50) != shapes.many_pictures(50, seed=1)
    assert set(p.size for p in shapes.many_pictures(200)) == set(shapes.MANY_SIZES)
    # one size draws nothing from the stream: the demo split is the 64-pixel one it always was
    assert shapes.plan("shapes_eval", 2) == shapes.plan("shapes_eval", 2, sizes=(shapes.SIZE,))
    assert {p.size for p in shapes.plan("shapes_eval", 2)} == {64}


def test_count_option_writes_only_the_large_set(tmp_path, capsys):
    assert shapes.main(["--out", str(tmp_path), "--count", "12"]) == 0
    assert "wrote 13 files" in capsys.readouterr().out
    assert list(json.loads((tmp_path / "dataset_info.json").read_text())) == ["shapes_many"]
