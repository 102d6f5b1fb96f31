"""The RL stages with DeepSpeed ZeRO roles on a real local Ray (CPU, gloo).

* grpo, ZeRO-3: two policy workers whose LoRA model is sharded between them, a vLLM engine fed by
  the collective push (the shards gathered on both ranks for rank 0's packing), a checkpoint written
  by the DeepSpeed engines, the final adapter saved whole. The engine's log-probs for its samples
  equal the policy's at every step, so each push carried the gathered, updated weights.
* ppo, ZeRO-2: two policy workers and a critic, resumed from checkpoint-2 (DeepSpeed's shards
  loaded by every rank of both roles) repeats the unbroken run's step 3 exactly.
"""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

from cluster.driver import run_exp
from stages.training.callbacks import read_log
from tests.e2e.conftest import REPO_ROOT, example_config
from tests.e2e.test_rl_resume import PARAM_TOL, _steps, ppo_config, run_stopped_at

STEPS = 3


def test_grpo_zero3_policy_pushes_gathered_weights_and_checkpoints(ray_session, tmp_path):
    out = tmp_path / "out"
    config = example_config("grpo_lora.yaml", tmp_path, output_dir=str(out), max_steps=STEPS, logging_steps=1,
                            ray_num_workers=2, eval_dataset=None, learning_rate=1e-2, save_steps=2,
                            rollout_weight_sync="collective",
                            deepspeed=os.path.join(REPO_ROOT, "configs", "deepspeed", "ds_z3_config.json"))
    result = run_exp(config)

    steps = [r for r in read_log(result.output_dir) if r.get("current_steps", 0) > 0 and "reward" in r]
    assert len(steps) == STEPS
    assert all(r["grad_norm"] > 0 for r in steps)  # DeepSpeed's norm, logged
    assert steps[-1]["kl"] > 1e-4  # the adapter moved the policy away from its base ...
    # ... and every push reached the engine whole: its samples' log-probs are the policy's
    assert all(r["rollout_logprob_diff_max"] < 1e-4 for r in steps), [r["rollout_logprob_diff_max"] for r in steps]
    shards = sorted(os.listdir(out / "checkpoint-2" / "policy" / "zero"))
    assert [s for s in shards if "optim_states" in s] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                          for r in (0, 1)], shards
    for name in ("adapter_model.safetensors", "adapter_config.json", "chat_template.jinja"):
        assert (out / name).exists(), name


def test_ppo_zero2_roles_resume_from_their_deepspeed_checkpoint_exactly(ray_session, tmp_path):
    def ppo(output_dir, **overrides):
        return ppo_config(output_dir, ray_num_workers=2, reward_funcs=["digit_ratio"],
                          deepspeed=os.path.join(REPO_ROOT, "configs", "deepspeed", "ds_z2_config.json"), max_steps=3,
                          **overrides)

    a = run_exp(ppo(tmp_path / "a"))
    for role in ("policy", "critic"):
        assert (tmp_path / "a" / "checkpoint-2" / role / "zero").is_dir(), role
    b_dir = run_stopped_at(tmp_path / "a", tmp_path / "b", 2)
    resumed = run_exp(ppo(b_dir, resume_from_checkpoint=str(b_dir / "checkpoint-2")))

    a_steps, b_steps = _steps(a.output_dir), _steps(resumed.output_dir)
    assert sorted(b_steps) == [1, 2, 3]
    for key in ("reward", "loss", "kl", "lr", "grad_norm"):
        assert b_steps[3][key] == pytest.approx(a_steps[3][key], abs=PARAM_TOL), key
    assert a_steps[3]["lr"] != a_steps[1]["lr"]  # the linear schedule moved: the restored one is compared
    for name in ("adapter_model.safetensors", os.path.join("critic", "adapter_model.safetensors")):
        a_weights, b_weights = (load_file(os.path.join(out, name)) for out in (a.output_dir, resumed.output_dir))
        assert max((a_weights[k] - b_weights[k]).abs().max().item() for k in a_weights) <= PARAM_TOL, name
