"""`rayfactory train` mistakes that fail before Ray starts, through the real command in a
subprocess: the error paragraph names the dataset, template or path, and no local Ray was started.
(The mistakes found once Ray runs, a bad row or too many workers, are tests/e2e/test_user_errors.py's;
these start no Ray, so they run beside the other tests that start none.)"""

from __future__ import annotations

import pytest

from tests.e2e.test_user_errors import error_paragraph, rayfactory_train, started_local_ray, write_config, write_dataset


def test_dpo_on_single_answer_data_fails_before_ray_starts(tmp_path):
    write_dataset(tmp_path)
    write_config(tmp_path, stage="dpo")
    done = rayfactory_train(tmp_path)
    message = error_paragraph(done)
    assert message == (
        f"Stage 'dpo' trains on preference pairs, but dataset 'mine' (in {tmp_path / 'data' / 'dataset_info.json'}) "
        "is not a ranking dataset: it lacks \"ranking\": true and the columns \"chosen\" and \"rejected\". "
        "Use a ranking dataset or add them."
    )
    assert not started_local_ray(tmp_path, done)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"dataset": "mien"},
            "Dataset 'mien' is not defined in {data}/dataset_info.json. Did you mean: mine?",
        ),
        (
            {"template": "qwen9"},
            "template: Unknown template 'qwen9'. Did you mean 'qwen', 'qwen3', 'qwen2_vl'? Run `rayfactory templates`",
        ),
        (
            {"model_name_or_path": "./models/my-model"},
            "model_name_or_path './models/my-model' does not exist (looked for {tmp}/models/my-model). "
            "Point it at a model folder, use a hub id such as Qwen/Qwen2.5-0.5B-Instruct, tiny:qwen2 for a tiny test "
            "model, or demo:smollm2-135m-instruct for a real small one.",
        ),
        (
            {"model_name_or_path": "/nonexistent/models/my-model"},
            "model_name_or_path '/nonexistent/models/my-model' does not exist "
            "(looked for /nonexistent/models/my-model).",
        ),
        (
            {"stage": "dpo", "finetuning_type": "lora", "ref_model": "./models/ref"},
            "ref_model './models/ref' does not exist (looked for {tmp}/models/ref). Point it at a model folder",
        ),
        (
            {"finetuning_type": "lora", "adapter_name_or_path": "./out/sft-lora"},
            "adapter_name_or_path './out/sft-lora' does not exist (looked for {tmp}/out/sft-lora). "
            "Point it at a folder holding adapter_config.json",
        ),
    ],
    ids=["unknown-dataset", "unknown-template", "missing-relative-model", "missing-absolute-model",
         "missing-ref-model", "missing-adapter"],
)
def test_config_mistakes_fail_before_ray_starts(tmp_path, overrides, expected):
    write_dataset(tmp_path)
    write_config(tmp_path, **overrides)
    done = rayfactory_train(tmp_path)
    message = error_paragraph(done)
    assert message.startswith(expected.format(tmp=tmp_path, data=tmp_path / "data")), message
    assert not started_local_ray(tmp_path, done)
