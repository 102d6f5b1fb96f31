"""DataArguments: LLaMA-Factory names and defaults, normalisation, and one clear error per mistake."""

import pytest

from registries.datasets import DataArguments, DataConfigError


def test_defaults_match_llamafactory():
    args = DataArguments()
    assert args.to_dict() == {
        "template": None, "dataset": None, "eval_dataset": None, "dataset_dir": "data", "cutoff_len": 2048,
        "train_on_prompt": False, "mask_history": False, "mix_strategy": "concat", "interleave_probs": None,
        "max_samples": None, "val_size": 0.0, "packing": None, "neat_packing": False, "tool_format": None,
        "default_system": None, "enable_thinking": True, "tokenized_path": None, "overwrite_cache": False,
        "skip_bad_rows": False, "streaming": False, "buffer_size": 16384, "padding_free": None,
        "preprocessing_engine": "auto", "escape_special_tokens": None,
        "image_max_pixels": 768 * 768, "image_min_pixels": 32 * 32,  # LLaMA-Factory's ProcessorArguments
    }


def test_comma_separated_names_become_lists():
    args = DataArguments(dataset="arith_train, identity", eval_dataset="arith_eval")
    assert (args.dataset, args.eval_dataset) == (["arith_train", "identity"], ["arith_eval"])
    assert DataArguments(dataset=["a", "b"]).dataset == ["a", "b"]


def test_interleave_probs_from_string():
    args = DataArguments(dataset="a,b", mix_strategy="interleave_under", interleave_probs="0.7, 0.3")
    assert args.interleave_probs == [0.7, 0.3]


def test_preprocessing_engine_is_one_of_three_and_a_stream_needs_ray_data():
    assert DataArguments(preprocessing_engine="driver").preprocessing_engine == "driver"
    with pytest.raises(DataConfigError) as err:
        DataArguments(preprocessing_engine="local")
    assert str(err.value) == "Data arguments: preprocessing_engine is 'local'; expected one of auto, driver, ray_data."
    with pytest.raises(DataConfigError) as err:
        DataArguments(dataset="a", streaming=True, preprocessing_engine="driver")
    assert str(err.value) == (
        "Data arguments: streaming: true cannot be combined with preprocessing_engine 'driver': a stream is read "
        "by Ray Data tasks as the workers train; remove preprocessing_engine, or set streaming: false."
    )
    assert DataArguments(dataset="a", streaming=True, preprocessing_engine="ray_data").streaming


def test_neat_packing_turns_packing_on():
    assert DataArguments(neat_packing=True).packing is True


def test_from_dict_builds_and_rejects_unknown_keys():
    assert DataArguments.from_dict({"dataset": "a", "cutoff_len": 64}).cutoff_len == 64
    with pytest.raises(DataConfigError, match=r"^Data arguments: unknown option\(s\) cutof_len, datset\. Known options: "):
        DataArguments.from_dict({"datset": "a", "cutof_len": 64})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"cutoff_len": 0}, "Data arguments: cutoff_len is 0; expected a positive integer (the maximum tokens per example)."),
        ({"cutoff_len": "512"}, "Data arguments: cutoff_len is '512'; expected a positive integer (the maximum tokens per example)."),
        ({"max_samples": -1}, "Data arguments: max_samples is -1; expected a positive integer, or null for all rows."),
        ({"mix_strategy": "shuffle"}, "Data arguments: mix_strategy is 'shuffle'; expected one of concat, interleave_under, interleave_over."),
        ({"train_on_prompt": "yes"}, "Data arguments: train_on_prompt is 'yes'; expected true or false."),
        ({"skip_bad_rows": 1}, "Data arguments: skip_bad_rows is 1; expected true or false."),
        ({"dataset": "a,,b"}, "Data arguments: dataset is 'a,,b'; expected non-empty dataset names (check for a stray comma)."),
        ({"dataset": 3}, "Data arguments: dataset is 3; expected dataset names: a comma-separated string or a list of strings."),
        ({"template": 7}, "Data arguments: template is 7; expected a string."),
        ({"dataset": "a", "val_size": -0.1}, "Data arguments: val_size is -0.1; expected a fraction in (0, 1) or a row count >= 1 (0 for no validation split)."),
        ({"dataset": "a", "val_size": 1.0}, "Data arguments: val_size is 1.0; expected a fraction below 1 (1.0 would leave nothing to train on); for one row write 1."),
        ({"dataset": "a", "val_size": 2.5}, "Data arguments: val_size is 2.5; expected a fraction in (0, 1) or a whole row count >= 1."),
        ({"val_size": 0.1}, "Data arguments: val_size is set but no dataset is given to split. Set dataset."),
        ({"dataset": "a", "eval_dataset": "b", "val_size": 0.1}, "Data arguments: val_size and eval_dataset are both set; the validation set would be ambiguous. Use one: val_size to split the training data, or eval_dataset."),
        ({"dataset": "a,b", "interleave_probs": "0.5,0.5"}, "Data arguments: interleave_probs is set but mix_strategy is 'concat', which does not sample. Set mix_strategy to interleave_under or interleave_over, or remove interleave_probs."),
        ({"dataset": "a,b", "mix_strategy": "interleave_over", "interleave_probs": "0.5,0.6"}, "Data arguments: interleave_probs is '0.5,0.6'; expected positive numbers that sum to 1."),
        ({"dataset": "a,b", "mix_strategy": "interleave_over", "interleave_probs": "half,half"}, "Data arguments: interleave_probs is 'half,half'; expected numbers, e.g. '0.7,0.3' or [0.7, 0.3]."),
        ({"dataset": "a,b,c", "mix_strategy": "interleave_over", "interleave_probs": [0.5, 0.5]}, "Data arguments: interleave_probs has 2 values but dataset names 3 datasets (a, b, c). Give one probability per dataset."),
        ({"train_on_prompt": True, "mask_history": True}, "Data arguments: mask_history and train_on_prompt cannot both be true: mask_history trains only on the last response, train_on_prompt trains on every token. Set one to false."),
        ({"neat_packing": True, "packing": False}, "Data arguments: neat_packing: true needs packing, but packing is false. Remove packing: false (neat_packing turns packing on)."),
    ],
)
def test_errors(kwargs, message):
    with pytest.raises(DataConfigError) as err:
        DataArguments(**kwargs)
    assert str(err.value) == message


def test_val_size_accepts_fraction_and_count():
    assert DataArguments(dataset="a", val_size=0.1).val_size == 0.1
    assert DataArguments(dataset="a", val_size=50).val_size == 50
