"""Training learns, judged the way a user would: on held-out prompts, with the saved outputs.

Full fine-tuning of the random-init tiny Qwen2 on "What is a+b?" (arith_train) must answer
unseen sums (arith_eval) by greedy decoding. The LoRA quickstart run (2 workers) must leave an
adapter that plain peft loads, and whose eval loss the driver reports is the loss that adapter
really has on arith_eval (recomputed here), far below the base model's. LoRA on a random-init
base learns little exact match in a few steps, so loss, not accuracy, is its yardstick.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from cluster.driver import run_exp
from registries.models import load_tokenizer
from registries.templates import get_template
from registries.tokenize import IGNORE_INDEX
from registries.tokenize.supervised import encode_supervised_example
from stages.training.callbacks import read_log
from tests.replies import chat_replies, exact_match
from stages.loading import resolve_model_path
from tests.e2e.conftest import REPO_ROOT

DATA_DIR = os.path.join(REPO_ROOT, "data")
CUTOFF_LEN = 64


def base_dir() -> str:
    return resolve_model_path("tiny:qwen2")


def eval_rows() -> list[dict]:
    """arith_eval: 80 sums of two numbers below 20 that arith_train never shows."""
    with open(os.path.join(DATA_DIR, "arith_eval.json"), encoding="utf-8") as f:
        return json.load(f)


def tokenizer_and_template(model_dir: str):
    """What a user does with an output folder: its tokenizer, the template trained with."""
    tokenizer = load_tokenizer(model_dir)
    template = get_template("qwen")
    template.fix_tokenizer(tokenizer)
    return tokenizer, template


def load_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def accuracy(model, tokenizer, template) -> float:
    rows = eval_rows()
    prompts = [[{"role": "user", "content": r["instruction"]}] for r in rows]
    replies = chat_replies(model, tokenizer, template, prompts, max_new_tokens=8)
    return exact_match(replies, [r["output"] for r in rows])


@torch.no_grad()
def trainer_eval_loss(model, tokenizer, template, global_batch: int) -> float:
    """arith_eval loss as the Trainer reports it, recomputed one example at a time.

    transformers 5 averages over the tokens of each *global* eval batch (every rank divides its
    token-loss sum by the token count gathered from all ranks, ``average_tokens_across_devices``)
    and then over batches. Eval is not shuffled and each rank takes every other per-device batch,
    so global batch k is examples [k*global_batch, (k+1)*global_batch) in file order.
    """
    sums, counts = [], []
    for row in eval_rows():
        ids, labels = encode_supervised_example(
            tokenizer, template, [{"role": "user", "content": row["instruction"]}],
            [{"role": "assistant", "content": row["output"]}], system="", tools="", cutoff_len=CUTOFF_LEN,
        )
        count = sum(label != IGNORE_INDEX for label in labels[1:])  # the model shifts labels by one
        mean = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
        sums.append(mean * count)
        counts.append(count)
    assert len(sums) % global_batch == 0, "a short last batch would be weighted differently"
    batches = [sum(sums[i : i + global_batch]) / sum(counts[i : i + global_batch])
               for i in range(0, len(sums), global_batch)]
    return sum(batches) / len(batches)


# Measured here (4 seeds: 42, 1, 2, 3): 0.84, 0.93, 0.99, 0.81 exact match after these 800
# steps (~30 s of training on an idle 2-core machine); the untrained model scores 0. The bar of 0.5 sits far below
# every seed's result and far above chance.
FULL_SFT = dict(max_steps=800, learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=20, logging_steps=10)


@pytest.mark.slow
def test_full_sft_learns_held_out_addition(ray_session, sft_config):
    tokenizer, template = tokenizer_and_template(base_dir())
    before = accuracy(load_model(base_dir()), tokenizer, template)

    result = run_exp(sft_config(**FULL_SFT))

    tokenizer, template = tokenizer_and_template(result.output_dir)
    after = accuracy(load_model(result.output_dir), tokenizer, template)
    print(f"arith_eval exact match: base {before:.3f} -> trained {after:.3f}")
    assert before <= 0.05
    assert after >= 0.5
    steps = [r["current_steps"] for r in read_log(result.output_dir) if "loss" in r]
    assert steps == list(range(10, 801, 10))


def quickstart_config(output_dir, **overrides) -> dict:
    """configs/quickstart.yaml with absolute paths, test storage and fewer steps."""
    import yaml

    with open(os.path.join(REPO_ROOT, "configs", "quickstart.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.update(
        dataset_dir=DATA_DIR,
        output_dir=str(output_dir),
        ray_storage_path=os.path.join(str(output_dir), "ray"),
        **overrides,
    )
    config.pop("num_train_epochs")
    return config


QUICKSTART_STEPS = 60
EVAL_GLOBAL_BATCH = 8 * 2  # transformers' default per_device_eval_batch_size x the quickstart's 2 workers


def test_lora_quickstart_adapter_loads_with_peft_and_beats_the_base(ray_session, tmp_path):
    from peft import PeftModel

    config = quickstart_config(tmp_path / "quickstart", max_steps=QUICKSTART_STEPS)
    assert config["ray_num_workers"] == 2 and config["finetuning_type"] == "lora" and config["plot_loss"]
    assert "per_device_eval_batch_size" not in config  # EVAL_GLOBAL_BATCH assumes the default
    result = run_exp(config)
    out = result.output_dir

    with open(os.path.join(out, "adapter_config.json"), encoding="utf-8") as f:
        adapter = json.load(f)
    assert sorted(adapter["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                 "up_proj", "v_proj"]
    assert sorted(adapter["modules_to_save"]) == ["embed_tokens", "lm_head"]
    assert (adapter["r"], adapter["use_rslora"], adapter["use_dora"]) == (16, False, False)
    assert os.path.getsize(os.path.join(out, "training_loss.png")) > 0
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as f:
        reported = json.load(f)["eval_loss"]

    tokenizer, template = tokenizer_and_template(out)
    base = load_model(base_dir())
    ids = torch.tensor([template.encode_oneturn(tokenizer, [{"role": "user", "content": "What is 3+4?"},
                                                            {"role": "assistant", "content": ""}])[0]])
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    base_loss = trainer_eval_loss(base, tokenizer, template, EVAL_GLOBAL_BATCH)

    tuned = PeftModel.from_pretrained(base, out).eval()  # plain peft, no RayFactory code
    with torch.no_grad():
        tuned_logits = tuned(input_ids=ids).logits
    tuned_loss = trainer_eval_loss(tuned, tokenizer, template, EVAL_GLOBAL_BATCH)
    moved = (tuned_logits - base_logits).abs().max().item()
    print(f"arith_eval loss: base {base_loss:.4f}, adapter {tuned_loss:.4f}, reported {reported:.4f}; "
          f"largest logit change {moved:.2f}; exact match with adapter {accuracy(tuned, tokenizer, template):.3f}")

    assert moved > 1.0  # the adapter changes what the model says
    # The reported eval loss is this adapter's loss on arith_eval (float rounding aside) ...
    assert tuned_loss == pytest.approx(reported, rel=1e-4)
    # ... and far below the untrained base's (~ln(vocab) = 6.9 for random weights).
    assert reported < 0.5 * base_loss
