"""The shapes preference sets: the same questions about the same pictures as shapes_train and
shapes_eval, the right answer chosen and a wrong one of the same kind rejected; deterministic, and
readable as LLaMA-Factory ranking rows with images."""

import json
from pathlib import Path

from registries.datasets import align_rows, get_dataset_attrs, read_rows
from registries.synthetic import shapes

DATA = Path(__file__).resolve().parents[2] / "data"


def test_chosen_is_right_and_rejected_a_wrong_answer_of_the_same_kind():
    for name, pictures_of in shapes.PREF_SPLITS.items():
        pictures = shapes.plan(pictures_of, shapes.SPLITS[pictures_of])
        pairs = shapes.pref_rows(pictures, name)
        assert pairs == shapes.pref_rows(pictures, name)
        assert len(pairs) == 2 * len(pictures)
        for pair, row in zip(pairs, shapes.rows(pictures)):
            assert pair["messages"] == row["messages"][:1] and pair["images"] == row["images"]
            assert pair["chosen"] == row["messages"][1]
            right, wrong = pair["chosen"]["content"], pair["rejected"]["content"]
            kind = shapes.COLOURS if right in shapes.COLOURS else shapes.SHAPES
            assert wrong != right and wrong in kind
        # every wrong answer turns up: the rejected side is no fixed word a model could learn to avoid
        assert {p["rejected"]["content"] for p in pairs} == set(shapes.COLOURS) | set(shapes.SHAPES)


def test_committed_preference_sets_match_the_generator_and_align_as_ranking_rows():
    info = json.loads((DATA / "dataset_info.json").read_text())
    for name, pictures_of in shapes.PREF_SPLITS.items():
        assert info[name] == shapes.entry(name)
        pictures = shapes.plan(pictures_of, shapes.SPLITS[pictures_of])
        assert json.loads((DATA / f"{name}.json").read_text()) == shapes.pref_rows(pictures, name)
    [attr] = get_dataset_attrs(["shapes_pref_eval"], str(DATA))
    first = align_rows(read_rows(attr), attr).examples[0]
    assert first["_prompt"] == [{"role": "user", "content": "<image>What colour is the shape?"}]
    assert [m["content"] for m in first["_response"]] == ["red", "yellow"]
    assert first["_images"] == [str(DATA / "shapes" / "shapes_eval_000.png")]
