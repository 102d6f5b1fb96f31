"""do_predict for stage sft (LLaMA-Factory's predict_with_generate): ChatModel actors on Ray Data
answer the eval rows; generated_predictions.jsonl and the BLEU/ROUGE results land in output_dir.

Two small Ray runs (1 and 2 workers, do_train false) on a LoRA output made in seconds, compared
with ChatModel in this process; the config mistakes are refused before Ray starts."""

from __future__ import annotations

import json
import os

import pytest

from cluster.config import ConfigError
from cluster.driver import run_exp
from tests.e2e.conftest import DATA_DIR
from tests.inference.conftest import BASE, TEMPLATE, make_adapter_output

ROWS = 5


def predict_config(output_dir, adapter, **overrides) -> dict:
    config = {
        "model_name_or_path": BASE, "adapter_name_or_path": adapter, "template": TEMPLATE,
        "stage": "sft", "finetuning_type": "lora", "do_train": False, "do_predict": True,
        "predict_with_generate": True, "eval_dataset": "arith_eval", "dataset_dir": DATA_DIR, "max_samples": ROWS,
        "do_sample": False, "max_new_tokens": 6, "output_dir": str(output_dir), "ray_num_workers": 1,
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_adapter_output(tmp_path_factory.mktemp("predict_adapter") / "math", seed=1)


@pytest.fixture(scope="module")
def runs(ray_session, adapter, tmp_path_factory):
    """{workers: (RunResult, output_dir)} for a 1- and a 2-worker prediction run."""
    root = tmp_path_factory.mktemp("predict")
    return {n: (run_exp(predict_config(root / f"w{n}", adapter, ray_num_workers=n)), root / f"w{n}") for n in (1, 2)}


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_predictions_are_chat_model_greedy_replies_in_row_order(runs, adapter):
    from cluster.api import ChatModel

    _, out = runs[1]
    lines = read_jsonl(out / "generated_predictions.jsonl")
    with open(os.path.join(DATA_DIR, "arith_eval.json"), encoding="utf-8") as f:
        rows = json.load(f)[:ROWS]
    assert len(lines) == ROWS
    assert [line["label"] for line in lines] == [row["output"] for row in rows]

    chat = ChatModel({"model_name_or_path": BASE, "adapter_name_or_path": adapter, "template": TEMPLATE,
                      "do_sample": False, "max_new_tokens": 6})
    for line, row in zip(lines, rows):
        messages = [{"role": "user", "content": row["instruction"]}]
        assert line["predict"] == chat.chat(messages)[0].response_text
        # the prompt as the model saw it: the template's text, special tokens kept
        assert line["prompt"] == chat.tokenizer.decode(chat.prompt_ids(messages), skip_special_tokens=False)
        assert f"<|im_start|>user\n{row['instruction']}<|im_end|>\n<|im_start|>assistant\n" in line["prompt"]
    assert len({line["predict"] for line in lines}) > 1  # the adapter answers differently per prompt


def test_metrics_files_hold_the_scores_of_the_jsonl(runs):
    from stages.inference.metrics import mean_scores

    result, out = runs[1]
    lines = read_jsonl(out / "generated_predictions.jsonl")
    expected = mean_scores((line["predict"], line["label"]) for line in lines)
    assert set(expected) == {"predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l"}
    for name in ("predict_results.json", "all_results.json"):
        with open(out / name, encoding="utf-8") as f:
            saved = json.load(f)
        assert {k: saved[k] for k in expected} == expected
        assert saved["predict_runtime"] > 0 and saved["predict_samples_per_second"] > 0
    assert {k: result.metrics[k] for k in expected} == expected
    # prediction only: no training happened, so no trainer output and no checkpoint
    assert result.checkpoint_path is None and result.data_stats["eval_examples"] == ROWS
    assert sorted(os.listdir(out)) == ["all_results.json", "generated_predictions.jsonl", "predict_results.json"]


def test_two_workers_write_the_same_predictions_as_one(runs):
    one = read_jsonl(runs[1][1] / "generated_predictions.jsonl")
    two = read_jsonl(runs[2][1] / "generated_predictions.jsonl")
    assert two == one
    # both workers answered rows (5 rows -> blocks of 3 and 2, one per actor)
    assert runs[1][0].data_stats["predict_workers"] == 1 and runs[2][0].data_stats["predict_workers"] == 2


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"eval_dataset": None}, "eval_dataset is not set"),
        ({"predict_with_generate": False}, "Set predict_with_generate: true"),
        ({"stage": "dpo", "eval_dataset": "arith_pref_eval"}, "built for stage sft only"),
        ({"do_predict": False}, "nothing to do"),
    ],
)
def test_config_mistakes_are_refused_before_ray(tmp_path, overrides, words):
    config = predict_config(tmp_path / "out", "unused", **overrides)
    config.pop("adapter_name_or_path")
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ConfigError, match=words):
        run_exp(config)
    assert not os.path.exists(tmp_path / "out")


def test_predict_after_training_uses_the_trained_adapter(ray_session, sft_config):
    from cluster.api import ChatModel

    config = sft_config(model_name_or_path=BASE, finetuning_type="lora", max_steps=2, max_samples=3,
                        do_train=True, do_predict=True, predict_with_generate=True, eval_dataset="arith_eval",
                        do_sample=False, max_new_tokens=4)
    result = run_exp(config)
    out = result.output_dir
    lines = read_jsonl(os.path.join(out, "generated_predictions.jsonl"))
    assert [line["label"] for line in lines] == ["0", "1", "2"][: len(lines)] and len(lines) == 3
    chat = ChatModel({"model_name_or_path": BASE, "adapter_name_or_path": out, "do_sample": False, "max_new_tokens": 4})
    assert [line["predict"] for line in lines] == [
        chat.chat([{"role": "user", "content": q}])[0].response_text for q in ("What is 0+0?", "What is 0+1?", "What is 0+2?")
    ]
    assert "loss" in result.metrics and "predict_rouge-l" in result.metrics  # training's metrics, then ours
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as f:
        merged = json.load(f)
    assert "predict_bleu-4" in merged and "train_loss" in merged  # the Trainer's results, with ours merged in

    # A rerun of the finished run trains nothing but still predicts (a failed predict can be redone)
    os.remove(os.path.join(out, "generated_predictions.jsonl"))
    with open(os.path.join(out, "trainer_log.jsonl"), encoding="utf-8") as f:
        log = f.read()
    again = run_exp({**config, "resume_from_checkpoint": "auto"})
    assert read_jsonl(os.path.join(out, "generated_predictions.jsonl")) == lines
    assert "loss" not in again.metrics and "predict_rouge-l" in again.metrics
    with open(os.path.join(out, "trainer_log.jsonl"), encoding="utf-8") as f:
        assert f.read() == log
    assert not any(name == "checkpoint-3" for name in os.listdir(out))
