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
