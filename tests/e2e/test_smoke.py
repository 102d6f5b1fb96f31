"""The smallest end-to-end run: config -> Ray Data -> one Ray Train worker -> output_dir."""

import os

from cluster.driver import run_exp
from stages.callbacks import read_log


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
