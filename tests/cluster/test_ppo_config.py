"""Stage ppo's config: LLaMA-Factory's PPO YAML loads, its own defaults and step sizing, one exact error
per user mistake (cluster/rl_checks.py), and the roles a run places (fabric/rl_launcher.role_specs).
No Ray: role_specs only describes the placement groups."""

from __future__ import annotations

import os

import pytest

from cluster.config import load_config
from fabric.placement import RoleSpec
from fabric.rl_launcher import role_specs
from stages.rl.config.rl_args import PPO_DEFAULTS
from tests.cluster.conftest import BASE, error_of, write

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.usefixtures("in_tmp")

# examples/train_lora/llama3_lora_ppo.yaml from LLaMA-Factory, with three substitutions so it runs
# here: the tiny model for Llama-3, our identity dataset for identity,alpaca_en_demo (plus dataset_dir,
# since the test runs in its own folder), and the reward model folder is a fake made by the test.
LF_PPO_LORA = f"""\
### model
model_name_or_path: tiny:qwen2
reward_model: saves/llama3-8b/lora/reward
trust_remote_code: true

### method
stage: ppo
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity
dataset_dir: {os.path.join(REPO, "data")}
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/ppo
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-5
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000

### generate
max_new_tokens: 512
top_k: 0
top_p: 0.9
"""

# The smallest valid ppo config: a reward function scores the completions.
PPO = {**BASE, "stage": "ppo", "reward_funcs": ["exact_match"]}


def fake_reward_model(folder: str, lora: bool = True) -> str:
    """What the config checks look for in a stage rm output: its value head file and, for a LoRA
    reward model, adapter_config.json (their contents are read only when the run loads them)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "value_head.safetensors"), "wb") as f:
        f.write(b"not read by the config checks")
    if lora:
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            f.write("{}")
    return folder


# --- LLaMA-Factory's PPO example ------------------------------------------------------------------


def test_llamafactory_ppo_lora_yaml_loads(tmp_path):
    fake_reward_model("saves/llama3-8b/lora/reward")
    run = load_config(write(LF_PPO_LORA))
    tuning, rl, gen = run.finetuning, run.rl, run.generating
    assert (tuning.stage, tuning.finetuning_type, tuning.lora_rank, tuning.lora_target) == ("ppo", "lora", 8, ["all"])
    assert tuning.reward_model == str(tmp_path / "saves/llama3-8b/lora/reward")  # made absolute for the actors
    assert tuning.reward_model_type == "lora"  # LLaMA-Factory's default, and what the folder holds
    # LLaMA-Factory's PPO step: per_device_train_batch_size 1 x gradient_accumulation_steps 8
    # x ppo_buffer_size 1 x 1 worker = 8 prompts, each answered once, max_new_tokens long.
    assert rl.rollout_batch_size == 1 * 8 * 1 * 1
    assert rl.num_generations == 1 and rl.completions_per_step == 8
    assert rl.max_completion_length == 512
    # top_k and top_p as the YAML says; temperature, which it leaves out, samples the model as it is.
    assert (gen.top_p, gen.top_k, gen.temperature) == (0.9, 0, 1.0)
    # Stage ppo's defaults (a critic and GAE, a k1 KL penalty from TRL's 0.2) and LLaMA-Factory's ppo_* ones.
    assert (rl.advantage_estimator, rl.kl_estimator, rl.beta) == ("gae", "k1", 0.2)
    assert rl.uses_critic
    assert (rl.ppo_epochs, rl.ppo_buffer_size, rl.ppo_target, rl.ppo_score_norm, rl.ppo_whiten_rewards) == (
        4, 1, 6.0, False, False)
    assert run.data.overwrite_cache is True and run.data.cutoff_len == 2048 and run.data.max_samples == 1000
    assert run.training.values["dataloader_num_workers"] == 4 and run.training.values["learning_rate"] == 1.0e-5
    assert run.notes == [
        "ignored 'preprocessing_num_workers' from cfg.yaml: Ray Data sizes the preprocessing parallelism itself "
        "(see preprocessing_engine).",
        "translated warmup_ratio: 0.1 to warmup_steps: 0.1: transformers 5 reads a warmup_steps below 1 as a fraction "
        "of the total steps, so the warmup is 10% of the training steps, as warmup_ratio meant.",
    ]
    assert [(r.name, r.colocate_with) for r in role_specs(run.ray, run)] == [
        ("policy", None), ("rollout", None), ("critic", None), ("reward", None)]


def test_resolved_ppo_config_repeats_the_same_run():
    """The saved config writes the derived step size and defaults out, so reloading it (every key now
    explicit) changes nothing, also with a different worker count and buffer size."""
    fake_reward_model("saves/llama3-8b/lora/reward")
    run = load_config(write(LF_PPO_LORA), ["ppo_buffer_size=2", "ray_num_workers=2"])
    assert run.rl.rollout_batch_size == 1 * 8 * 2 * 2
    again = load_config(run.write_yaml())
    assert again.resolved() == run.resolved() and again.notes == []


def test_ppo_defaults_are_the_documented_table():
    assert PPO_DEFAULTS == {"advantage_estimator": "gae", "num_generations": 1, "kl_estimator": "k1", "beta": 0.2}
    rl = load_config(dict(PPO)).rl
    assert {key: getattr(rl, key) for key in PPO_DEFAULTS} == PPO_DEFAULTS
    grpo = load_config({**PPO, "stage": "grpo"}).rl  # grpo keeps RLArguments' own defaults
    assert (grpo.advantage_estimator, grpo.num_generations, grpo.kl_estimator, grpo.beta) == ("group_norm", 4, "k3", 0.0)


def test_step_size_counts_every_policy_worker():
    run = load_config({**PPO, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 3,
                       "ppo_buffer_size": 2, "ray_num_workers": 2})
    assert run.rl.rollout_batch_size == 24  # 2 x 3 per worker per mini-batch, 2 mini-batches, 2 workers


def test_completion_length_without_max_new_tokens_is_the_rl_default():
    # generating's max_new_tokens default (1024, for chat) is not a rollout length; only a written one is.
    assert load_config(dict(PPO)).rl.max_completion_length == 32


# --- explicit keys beat stage ppo's defaults --------------------------------------------------------


def test_explicit_keys_beat_ppo_defaults():
    run = load_config({**PPO, "kl_estimator": "k3", "rollout_batch_size": 5, "num_generations": 2,
                       "max_new_tokens": 512, "max_completion_length": 16,
                       "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}, ["beta=0.0"])
    rl = run.rl
    assert (rl.beta, rl.kl_estimator, rl.rollout_batch_size, rl.num_generations) == (0.0, "k3", 5, 2)
    assert rl.max_completion_length == 16
    assert rl.advantage_estimator == "gae"  # not written: still the ppo default


def test_an_explicit_group_estimator_replaces_gae():
    rl = load_config({**PPO, "advantage_estimator": "group_norm", "num_generations": 4}).rl
    assert (rl.advantage_estimator, rl.num_generations, rl.uses_critic) == ("group_norm", 4, False)
    assert (rl.kl_estimator, rl.beta) == ("k1", 0.2)  # the keys not written keep ppo's defaults


# --- errors: one exact message per mistake ----------------------------------------------------------


def test_nothing_to_score_with():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nstage: ppo\n")) == (
        "stage ppo in cfg.yaml needs something to score completions: reward_model (the output_dir of a "
        "stage rm run) or reward_funcs (e.g. [exact_match] or [my_rewards:score]), or both."
    )


API = {**BASE, "stage": "ppo", "reward_model_type": "api"}
API_FIX = (
    "Set reward_model to e.g. http://rm-host:8000/v1/score (`rayfactory serve` of a stage rm output), a server "
    "speaking OpenRLHF's remote reward JSON (http://host:5000/get_reward), or an LLM judge's "
    "http://host:8000/v1/chat/completions; or, for a reward model folder, set reward_model_type lora or full."
)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1/score", "https://rm.example.com/get_reward",
                                 "http://judge:8000/v1/chat/completions"])
def test_reward_api_takes_a_url(url):
    run = load_config({**API, "reward_model": url})
    assert run.finetuning.reward_model == url  # not made a path, not checked as a folder
    assert run.finetuning.reward_model_folder is None
    assert run.rl.critic_init is None and run.rl.reward_api_timeout == 30.0 and run.rl.reward_api_retries == 3


@pytest.mark.parametrize("url, problem", [
    ("saves/rm", "reward_model 'saves/rm' is not an http:// or https:// URL with a host"),
    ("ftp://host/score", "reward_model 'ftp://host/score' is not an http:// or https:// URL with a host"),
    ("http:///v1/score", "reward_model 'http:///v1/score' is not an http:// or https:// URL with a host"),
    ("http://host:port/v1/score", "reward_model 'http://host:port/v1/score' is not a valid URL (Port could not be "
                                  "cast to integer value as 'port')"),
])
def test_reward_api_refuses_what_is_not_a_url(url, problem):
    fake_reward_model("saves/rm")  # even an rm output: api means a URL
    assert error_of({**API, "reward_model": url}) == (
        "reward_model_type api in the config dict scores completions through a remote API, so reward_model (in "
        f"the config dict) must be its URL, but {problem}. {API_FIX}"
    )


def test_reward_api_without_a_url():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nstage: ppo\nreward_funcs: [exact_match]\n"
                          "reward_model_type: api\n")) == (
        "reward_model_type api in cfg.yaml scores completions through a remote API, so reward_model (in "
        f"cfg.yaml) must be its URL, but reward_model is not set. {API_FIX}"
    )


def test_reward_api_has_no_weights_to_start_a_critic_from():
    assert error_of({**API, "reward_model": "http://rm:8000/v1/score", "critic_init": "reward"}) == (
        "critic_init reward in the config dict starts the critic from the reward model, but reward_model is a URL "
        "(reward_model_type api), with no weights to start from. Use critic_init: policy, or set reward_model to "
        "a stage rm output."
    )


@pytest.mark.parametrize("key, value, message", [
    ("reward_api_timeout", 0, "reward_api_timeout (seconds per attempt at the reward API) must be positive, got 0. "
                              "E.g. 30."),
    ("reward_api_retries", -1, "reward_api_retries (attempts after the first) must be >= 0, got -1. E.g. 3; 0 never "
                               "retries."),
    ("reward_api_concurrency", 0, "reward_api_concurrency must be at least 1, got 0."),
    ("reward_api_batch_size", 0, "reward_api_batch_size must be at least 1, got 0."),
])
def test_reward_api_client_options(key, value, message):
    assert error_of({**API, "reward_model": "http://rm:8000/v1/score", key: value}) == (
        f"invalid {key} in the config dict: {message}")


def test_reward_model_folder_without_a_value_head():
    os.makedirs("sft_out")
    with open("sft_out/adapter_config.json", "w") as f:
        f.write("{}")  # an SFT adapter: a model, but no reward head
    assert error_of({**BASE, "stage": "ppo", "reward_model": "sft_out"}) == (
        "reward_model 'sft_out' in the config dict holds no value_head.safetensors, so it is not a reward "
        "model saved by stage rm. Point it at the output_dir (or a checkpoint) of an rm run."
    )


def test_lora_reward_model_declared_full():
    fake_reward_model("rm", lora=True)
    assert error_of({**BASE, "stage": "ppo", "reward_model": "rm", "reward_model_type": "full"}) == (
        "reward_model 'rm' is a LoRA adapter, but reward_model_type is 'full' (in the config dict). "
        "Set reward_model_type: lora."
    )


def test_full_reward_model_declared_lora():
    fake_reward_model("rm_full", lora=False)
    # lora is LLaMA-Factory's default, so leaving reward_model_type out is the likely way to get here
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nstage: ppo\nreward_model: rm_full\n")) == (
        "reward_model 'rm_full' is a full model, but reward_model_type is 'lora' (in cfg.yaml). "
        "Set reward_model_type: full."
    )
    run = load_config({**BASE, "stage": "ppo", "reward_model": "rm_full", "reward_model_type": "full"})
    assert run.finetuning.reward_model_type == "full"


def test_reward_model_adapters_are_refused():
    fake_reward_model("rm")
    assert error_of({**BASE, "stage": "ppo", "reward_model": "rm", "reward_model_adapters": ["extra"]}) == (
        "reward_model_adapters in the config dict: adapters on top of a reward model are not "
        "supported; merge them with `rayfactory export` and point reward_model at the export."
    )


def test_critic_from_a_reward_model_that_is_not_there():
    assert error_of({**PPO, "critic_init": "reward"}) == (
        "critic_init reward in the config dict starts the critic from the reward model, but no "
        "reward_model is set. Use critic_init: policy, or set reward_model to a stage rm output."
    )
    assert load_config({**PPO, "critic_init": "policy"}).rl.critic_init == "policy"


def test_mini_batches_emptier_than_the_workers():
    # 2 prompts x 1 completion in 4 mini-batches: 2 // 4 = 0 completions for the one policy worker.
    assert error_of({**PPO, "rollout_batch_size": 2, "ppo_buffer_size": 4}) == (
        "a PPO step's 2 completions in ppo_buffer_size 4 mini-batches leave 0 per mini-batch, fewer than the "
        "1 policy/critic workers that each need one. Lower ppo_buffer_size (in the config dict) or raise "
        "rollout_batch_size."
    )


def test_mini_batches_count_the_critic_workers():
    # 4 completions in 2 mini-batches: 2 each, for 3 critic ranks (the policy has 1).
    assert error_of({**PPO, "rollout_batch_size": 4, "ppo_buffer_size": 2, "critic_num_workers": 3}) == (
        "a PPO step's 4 completions in ppo_buffer_size 2 mini-batches leave 2 per mini-batch, fewer than the "
        "3 policy/critic workers that each need one. Lower ppo_buffer_size (in the config dict) or raise "
        "rollout_batch_size."
    )
    assert load_config({**PPO, "rollout_batch_size": 6, "ppo_buffer_size": 2, "critic_num_workers": 3})
    # Without a critic its worker count does not matter: rloo, 2 x 2 completions, 2 mini-batches of 2.
    run = load_config({**PPO, "advantage_estimator": "rloo", "num_generations": 2, "rollout_batch_size": 2,
                       "ppo_buffer_size": 2, "critic_num_workers": 3})
    assert run.rl.completions_per_step == 4 and not run.rl.uses_critic


def test_gae_needs_stage_ppo():
    assert error_of({**PPO, "stage": "grpo", "advantage_estimator": "gae"}) == (
        "invalid advantage_estimator in the config dict: advantage_estimator gae needs a critic, which only "
        "stage ppo trains; stage grpo compares completions of one prompt instead. Use group_norm, dr_grpo, "
        "rloo, reinforce_baseline, reinforce_plus_plus or reinforce_plus_plus_baseline, or stage ppo."
    )


def test_gae_works_with_one_completion_per_prompt():
    rl = load_config({**PPO, "advantage_estimator": "gae", "num_generations": 1}).rl
    assert (rl.advantage_estimator, rl.num_generations, rl.uses_critic) == ("gae", 1, True)


def test_group_estimator_under_ppo_needs_a_group():
    # ppo's default num_generations is 1: rloo written alone has nothing to compare each completion with
    assert error_of({**PPO, "advantage_estimator": "rloo"}) == (
        "invalid num_generations in the config dict: advantage_estimator 'rloo' compares the completions of "
        "one prompt with each other, so num_generations must be at least 2 (got 1). "
        "Set num_generations: 4 (or more)."
    )
    assert load_config({**PPO, "advantage_estimator": "rloo", "num_generations": 2}).rl.num_generations == 2


@pytest.mark.parametrize("extra", [{}, {"advantage_estimator": "rloo", "num_generations": 4}])
def test_dynamic_filtering_is_refused_under_ppo(extra):
    """Stage ppo's loop trains on every group: dynamic_filtering would be accepted and do nothing."""
    assert error_of({**PPO, **extra, "dynamic_filtering": True}) == (
        "invalid dynamic_filtering in the config dict: dynamic_filtering drops the prompt groups whose "
        "completions all got the same reward, which only stage grpo does; stage ppo trains on every group, so "
        "the key would do nothing. Remove dynamic_filtering (or set it to false), or use stage: grpo."
    )


# --- the roles a run places -------------------------------------------------------------------------


def roles_of(config: dict) -> list[RoleSpec]:
    run = load_config(config)
    return role_specs(run.ray, run)  # a RunConfig carries the rl and finetuning a JobSpec does


def test_default_ppo_gives_every_role_its_own_bundles():
    fake_reward_model("rm")
    roles = roles_of({**BASE, "stage": "ppo", "reward_model": "rm", "ray_num_workers": 2,
                      "resources_per_worker": {"CPU": 2}, "rollout_num_engines": 3,
                      "rollout_resources": {"CPU": 1.5}, "reward_resources": {"CPU": 3}})
    # RoleSpec equality compares name, count, resources and colocate_with.
    assert roles == [
        RoleSpec("policy", 2, {"CPU": 2}),
        RoleSpec("rollout", 3, {"CPU": 1.5}),
        RoleSpec("critic", 2, {"CPU": 2}),  # critic_num_workers and critic_resources follow the policy's
        RoleSpec("reward", 1, {"CPU": 3}),
    ]
    assert [(r.num_actors_key, r.resources_key) for r in roles] == [
        ("ray_num_workers", "resources_per_worker"), ("rollout_num_engines", "rollout_resources"),
        ("critic_num_workers", "critic_resources"), ("reward_num_workers", "reward_resources")]


def test_critic_workers_and_resources_of_their_own():
    roles = roles_of({**PPO, "critic_num_workers": 3, "critic_resources": {"CPU": 0.5}})
    assert roles[2] == RoleSpec("critic", 3, {"CPU": 0.5})


def test_colocate_critic_reward_puts_the_reward_on_the_critic():
    fake_reward_model("rm")
    roles = roles_of({**BASE, "stage": "ppo", "reward_model": "rm", "colocate_critic_reward": True,
                      "reward_num_workers": 2})
    assert roles == [
        RoleSpec("policy", 1, {"CPU": 1}),
        RoleSpec("rollout", 1, {"CPU": 1}),
        RoleSpec("critic", 1, {"CPU": 1}),
        RoleSpec("reward", 2, {}, colocate_with="critic"),  # {}: shares all of the critic's bundle
    ]


def test_colocate_all_makes_every_role_a_guest_of_the_policy():
    fake_reward_model("rm")
    roles = roles_of({**BASE, "stage": "ppo", "reward_model": "rm", "colocate_all": True,
                      "critic_resources": {"CPU": 4}, "reward_resources": {"CPU": 4}})
    assert [(r.name, r.colocate_with) for r in roles] == [
        ("policy", None), ("rollout", "policy"), ("critic", "policy"), ("reward", "policy")]
    by_name = {r.name: r for r in roles}
    # critic and reward share everything the policy's bundles hold; their own resources keys are moot
    assert by_name["critic"].resources == {} and by_name["reward"].resources == {}
    assert by_name["policy"].resources == {"CPU": 1}


def test_hf_rollouts_have_no_engine_role():
    fake_reward_model("rm")
    roles = roles_of({**BASE, "stage": "ppo", "reward_model": "rm", "rollout_backend": "hf"})
    assert [r.name for r in roles] == ["policy", "critic", "reward"]


def test_reward_functions_alone_place_no_reward_model():
    assert [r.name for r in roles_of(dict(PPO))] == ["policy", "rollout", "critic"]


def test_a_reward_api_places_no_reward_model():
    # reward_resources and colocate_critic_reward would place one; a URL is called from the controller.
    roles = roles_of({**API, "reward_model": "http://rm:8000/v1/score", "reward_resources": {"CPU": 3},
                      "colocate_critic_reward": True})
    assert roles == [RoleSpec("policy", 1, {"CPU": 1}), RoleSpec("rollout", 1, {"CPU": 1}),
                     RoleSpec("critic", 1, {"CPU": 1})]


def test_a_group_estimator_places_no_critic():
    fake_reward_model("rm")
    roles = roles_of({**BASE, "stage": "ppo", "reward_model": "rm", "advantage_estimator": "rloo",
                      "num_generations": 2, "colocate_critic_reward": True})
    # with no critic to sit on, colocate_critic_reward puts the reward model on the policy's bundles
    assert roles == [
        RoleSpec("policy", 1, {"CPU": 1}),
        RoleSpec("rollout", 1, {"CPU": 1}),
        RoleSpec("reward", 1, {}, colocate_with="policy"),
    ]


def test_grpo_places_neither_critic_nor_reward_model():
    roles = roles_of({**PPO, "stage": "grpo", "rollout_num_engines": 2})
    assert roles == [RoleSpec("policy", 1, {"CPU": 1}), RoleSpec("rollout", 2, {"CPU": 1})]


JUDGE = {**API, "reward_model": "http://judge:8000/v1/chat/completions"}


def test_judge_keys_reach_the_config():
    run = load_config({**JUDGE, "reward_judge_rubric": "Grade {completion}. Score: N", "reward_judge_model": "g",
                       "reward_judge_max_score": 5})
    assert (run.rl.reward_judge_rubric, run.rl.reward_judge_model, run.rl.reward_judge_max_score) == (
        "Grade {completion}. Score: N", "g", 5)


@pytest.mark.parametrize("config, message", [
    ({**JUDGE, "reward_judge_rubric": "Grade the answer."},
     "invalid reward_judge_rubric in the config dict: reward_judge_rubric has no {completion} placeholder, so the "
     "judge would never see the answer it grades. Write the rubric with {completion} where the answer goes (and "
     '{prompt}, {reference} if wanted), asking for one line "Score: N".'),
    ({**JUDGE, "reward_judge_max_score": 0},
     "invalid reward_judge_max_score in the config dict: reward_judge_max_score (the judge's top score, which maps "
     "to reward 1) must be positive, got 0. E.g. 10."),
    ({**API, "reward_model": "http://rm:8000/v1/score", "reward_judge_model": "g"},
     "reward_judge_model in the config dict configures an LLM judge, but this run has none: the judge is stage "
     "ppo's reward_model with reward_model_type api and an OpenAI-style chat URL ending in /chat/completions (e.g. "
     "http://host:8000/v1/chat/completions). Set those, or remove the reward_judge_* keys."),
    ({**BASE, "stage": "grpo", "reward_funcs": ["exact_match"], "reward_judge_max_score": 5},
     "reward_judge_max_score in the config dict configures an LLM judge, but this run has none: the judge is stage "
     "ppo's reward_model with reward_model_type api and an OpenAI-style chat URL ending in /chat/completions (e.g. "
     "http://host:8000/v1/chat/completions). Set those, or remove the reward_judge_* keys."),
])
def test_judge_key_mistakes(config, message):
    assert error_of(config) == message
