"""The smallest end-to-end run: config -> Ray Data -> one Ray Train worker -> output_dir."""

import os

from cluster.driver import run_exp
from stages.training.callbacks import read_log


def test_sft_run_writes_outputs_and_loss_falls(ray_session, sft_config):
    result = run_exp(sft_config(max_steps=30))
    out = result.output_dir
    for name in ("model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja",
                 "trainer_state.json", "trainer_log.jsonl", "all_results.json", "rayfactory_config.yaml"):
        assert os.path.exists(os.path.join(out, name)), name
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert [r["current_steps"] for r in read_log(out) if "loss" in r] == list(range(1, 31))
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert result.data_stats == {"train_examples": 320, "eval_examples": 0}


def test_template_auto_is_resolved_once_and_pinned(ray_session, sft_config, tmp_path):
    """The driver detects the template once; the workers and the saved config get its name, so a
    rerun of rayfactory_config.yaml cannot detect something else."""
    import shutil

    import yaml

    from cluster.config import load_config
    from registries.models import load_tokenizer, tiny_model_path
    from registries.templates import get_template
    from registries.templates.jinja import to_jinja

    model = tmp_path / "model-with-qwen-chat-template"
    shutil.copytree(tiny_model_path("qwen2"), model)
    tokenizer = load_tokenizer(str(model))
    tokenizer.chat_template = to_jinja(get_template("qwen"), tokenizer)
    tokenizer.save_pretrained(model)

    cfg = load_config(sft_config(model_name_or_path=str(model), template="auto", max_steps=2))
    result = run_exp(cfg)
    assert cfg.data.template == "auto"  # the loaded config is not changed: the driver pins a copy
    with open(os.path.join(result.output_dir, "rayfactory_config.yaml"), encoding="utf-8") as f:
        assert yaml.safe_load(f)["template"] == "qwen"
    # what the workers trained with: the output's tokenizer carries that template's Jinja form
    trained = load_tokenizer(result.output_dir)
    assert trained.chat_template == to_jinja(get_template("qwen"), trained)
