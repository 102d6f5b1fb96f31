"""DeepSpeed ZeRO-2 and ZeRO-3 inside two Ray Train workers on CPU (gloo), with the shipped
configs/deepspeed/*.json.

One module on purpose: the first DeepSpeed use on a machine compiles the C++ op
deepspeed_shm_comm (~90 s, cached in ~/.cache/torch_extensions), so the cost is paid once.
The shipped configs name no optimizer: one would also compile CPU fused_adam (~190 s).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from cluster.driver import run_exp
from stages.training.callbacks import read_log

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DS_DIR = os.path.join(REPO_ROOT, "configs", "deepspeed")
STEPS = 12
WORKERS = 2


def _base_model_path() -> str:
    from stages.loading import resolve_model_path

    return resolve_model_path("tiny:qwen2")


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_trains_on_two_workers_and_saves_full_weights(ray_session, sft_config, zero_stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = run_exp(sft_config(
        deepspeed=os.path.join(DS_DIR, f"ds_z{zero_stage}_config.json"),
        ray_num_workers=WORKERS,
        per_device_train_batch_size=8,
        max_steps=STEPS,
        save_steps=STEPS,  # an HF checkpoint at the last step holds DeepSpeed's own shards
    ))
    out = result.output_dir

    # Every step logged once, and the loss falls.
    records = [r for r in read_log(out) if "loss" in r]
    assert [r["current_steps"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses

    # DeepSpeed really ran, with the optimizer state partitioned over both workers.
    shards = sorted(glob.glob(os.path.join(out, f"checkpoint-{STEPS}", f"global_step{STEPS}",
                                           "*zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    assert [os.path.basename(s).split("zero_pp_rank_")[1][0] for s in shards] == ["0", "1"], shards

    # The saved weights are whole (ZeRO-3 gathers them) and are exactly the trained fp32 master
    # weights, which zero_to_fp32 rebuilds independently from the two optimizer shards.
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(_base_model_path(), dtype=torch.float32)
    assert model.config.vocab_size == base.config.vocab_size  # no spurious resize under ZeRO-3
    saved = load_file(os.path.join(out, "model.safetensors"))
    master = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, f"checkpoint-{STEPS}"))
    assert set(saved) == set(master)
    for name, tensor in saved.items():
        assert tensor.numel() > 0 and tensor.shape == master[name].shape, name
        assert torch.equal(tensor.float(), master[name].float()), name
    loaded = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name

    # ...and they moved away from the base: the loaded model's logits differ from the base's.
    ids = torch.tensor([[5, 17, 42, 99, 7, 250]])
    with torch.no_grad():
        trained_logits = model(input_ids=ids).logits
        base_logits = base(input_ids=ids).logits
    assert (trained_logits - base_logits).abs().max() > 1e-2
