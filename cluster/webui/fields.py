"""The Train tab's fields: one entry per config key the form edits, with its section, kind,
default, help and page label (cluster/webui/form.py turns them into the form and back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.table import STAGES


@dataclass(frozen=True)
class Field:
    key: str  # the config key, LLaMA-Factory's name
    section: str  # the YAML section it is written under ("### model" ...)
    kind: str  # text | number | select | datasets | check | list
    default: Any = ""
    choices: tuple = ()  # select: fixed choices; filled from the registries by `form_spec`
    help: str = ""
    when: tuple = ()  # ("stage", "dpo", "kto"): shown (and written) only when that field has one of these values
    item: str = "text"  # list: what its comma-separated entries are (text | number); written as a YAML list


def _stages_where(fact) -> tuple:
    """A ``when`` for the stages whose entry in the stage table has ``fact``: ("stage", "dpo", ...)."""
    return ("stage", *(name for name, stage in STAGES.items() if fact(stage)))


SECTIONS = ("model", "method", "rl", "dataset", "output", "train", "ray")
RL = _stages_where(lambda stage: stage.rl is not None)  # the stages with an RL options group
RL_STAGES = RL[1:]
PREF_LOSS = _stages_where(lambda stage: stage.takes_pref_loss)
PREFERENCE = _stages_where(lambda stage: stage.token_logps)  # against a reference's log-probs: pref_beta
REWARD_MODEL = _stages_where(lambda stage: stage.rl is not None and stage.rl.reward_model)
# RL keys whose choices are their Literal type in stages/rl/config/rl_args.py (filled by `form_spec`) ...
RL_LITERALS = ("rollout_backend", "async_rollout")
# ... and those whose choices are the names registered for them (stages/rl/algorithms/registry.py).
RL_REGISTERED = ("advantage_estimator", "loss_type")
FIELDS: tuple[Field, ...] = (
    Field("model_name_or_path", "model", "text", "tiny:qwen2",
          help="hub id, local folder, tiny:<family> (random-init, offline) or demo:smollm2-135m-instruct"),
    Field("template", "model", "select", "auto", help="auto: the tokenizer's own chat template, else the model family's"),
    Field("stage", "method", "select", "sft"),
    Field("finetuning_type", "method", "select", "lora", choices=("lora", "full", "freeze")),
    Field("lora_rank", "method", "number", 8, when=("finetuning_type", "lora")),
    Field("lora_alpha", "method", "number", "", help="blank: 2 x lora_rank", when=("finetuning_type", "lora")),
    Field("lora_dropout", "method", "number", 0, when=("finetuning_type", "lora")),
    Field("lora_target", "method", "text", "all", help="module names, comma-separated; all = every linear layer",
          when=("finetuning_type", "lora")),
    Field("additional_target", "method", "text", "", help="modules trained fully beside the adapter",
          when=("finetuning_type", "lora")),
    Field("freeze_trainable_layers", "method", "number", 2, when=("finetuning_type", "freeze")),
    Field("pref_loss", "method", "select", "sigmoid", choices=("sigmoid", "hinge", "ipo", "orpo", "simpo"),
          when=PREF_LOSS),
    Field("pref_beta", "method", "number", 0.1, when=PREFERENCE),
    # --- RL (stage grpo / ppo; stages/rl/config/rl_args.py). Blank: the stage's own default, not written.
    Field("reward_funcs", "rl", "list", "", when=RL,
          help="comma-separated; built-ins exact_match, digit_ratio, final_number, number_format, short_answer, "
               "starts_with_answer, or module.path:function (grpo needs one; ppo: beside or instead of "
               "reward_model)"),
    Field("reward_weights", "rl", "list", "", item="number", when=RL,
          help="one weight per reward function, comma-separated; blank: 1.0 each"),
    Field("reward_model", "rl", "text", "", when=REWARD_MODEL,
          help="a stage rm output (folder), or a reward server's URL with reward_model_type api"),
    Field("reward_model_type", "rl", "select", "", choices=("lora", "full", "api"), when=REWARD_MODEL,
          help="lora: an rm adapter on this base model; full: a model of its own; api: a URL; blank: lora"),
    Field("num_generations", "rl", "number", "", when=RL, help="completions per prompt; blank: 4 (ppo: 1)"),
    Field("rollout_batch_size", "rl", "number", "", when=RL,
          help="prompts per step; blank: 8 (ppo: batch size x accumulation x ppo_buffer_size x workers)"),
    Field("max_completion_length", "rl", "number", "", when=RL,
          help="tokens per completion (multi-turn: the whole trajectory); blank: 32 (ppo: max_new_tokens)"),
    Field("beta", "rl", "number", "", when=RL, help="KL-to-reference weight, 0 loads no reference; blank: 0 "
                                                    "(ppo: 0.2, the adaptive controller's start)"),
    Field("loss_type", "rl", "select", "", when=RL, help="blank: dapo (token mean)"),
    Field("advantage_estimator", "rl", "select", "", when=RL,
          help="blank: group_norm (ppo: gae, its critic)"),
    Field("epsilon", "rl", "number", "", when=RL, help="clip range of the probability ratio; blank: 0.2"),
    Field("num_iterations", "rl", "number", "", when=RL, help="policy updates per rollout batch; blank: 1"),
    Field("rollout_backend", "rl", "select", "", when=RL,
          help="vllm: engines of their own; hf: generate() in the policy workers; blank: vllm"),
    Field("async_rollout", "rl", "select", "", when=RL,
          help="off; one_step: the next batch is sampled while this one trains; bounded: up to max_staleness "
               "batches ahead; blank: off"),
    Field("max_staleness", "rl", "number", "", when=RL,
          help="batches the engines may run ahead (async_rollout bounded only); blank: 1 for one_step, 2 for bounded"),
    Field("environment", "rl", "text", "", when=RL,
          help="multi-turn rollouts: tools (built-in) or module.path:Class; blank: tools if tools are listed, "
               "else single-turn"),
    Field("tools", "rl", "list", "", when=RL,
          help="comma-separated; built-ins calculator, python, or module.path:tool"),
    Field("max_turns", "rl", "number", "", when=RL, help="policy turns per trajectory; blank: 4"),
    Field("max_turn_tokens", "rl", "number", "", when=RL,
          help="tokens of one policy turn; blank: max_completion_length"),
    Field("dataset_dir", "dataset", "text", "data", help="the folder with dataset_info.json"),
    Field("dataset", "dataset", "datasets", ""),
    Field("eval_dataset", "dataset", "datasets", ""),
    Field("cutoff_len", "dataset", "number", 2048),
    Field("max_samples", "dataset", "number", ""),
    Field("output_dir", "output", "text", "saves/webui/run"),
    Field("overwrite_output_dir", "output", "check", False,
          help="replace the run already in the output folder; off: a folder holding a run is refused "
               "(Resume continues it)"),
    Field("logging_steps", "output", "number", 5),
    Field("save_steps", "output", "number", 100),
    Field("per_device_train_batch_size", "train", "number", 4),
    Field("gradient_accumulation_steps", "train", "number", 1),
    Field("learning_rate", "train", "number", 1.0e-4),
    Field("num_train_epochs", "train", "number", 3),
    Field("max_steps", "train", "number", "", help="blank: run num_train_epochs"),
    Field("lr_scheduler_type", "train", "select", "cosine",
          choices=("cosine", "linear", "constant", "constant_with_warmup", "polynomial")),
    Field("warmup_steps", "train", "number", 0),
    Field("bf16", "train", "check", False),
    Field("seed", "train", "number", 42),
    Field("ray_num_workers", "ray", "number", 1),
    Field("resources_per_worker", "ray", "number", 1, help="CPUs per worker (a GPU cluster: edit the YAML)"),
)
FIELD_BY_KEY = {f.key: f for f in FIELDS}
# What the page calls each field; the config key stays beside it ("Learning rate (learning_rate)").
LABELS = {
    "model_name_or_path": "Model", "template": "Chat template", "stage": "Training stage",
    "finetuning_type": "Fine-tuning method", "lora_rank": "LoRA rank", "lora_alpha": "LoRA alpha",
    "lora_dropout": "LoRA dropout", "lora_target": "LoRA target modules", "additional_target": "Fully trained modules",
    "freeze_trainable_layers": "Trainable layers", "pref_loss": "Preference loss", "pref_beta": "Preference beta",
    "reward_funcs": "Reward functions", "reward_weights": "Reward weights", "reward_model": "Reward model",
    "reward_model_type": "Reward model type", "num_generations": "Completions per prompt",
    "rollout_batch_size": "Rollout batch size", "max_completion_length": "Completion length",
    "beta": "KL weight", "loss_type": "Policy loss", "advantage_estimator": "Advantage estimator",
    "epsilon": "Clip range", "num_iterations": "Updates per batch", "rollout_backend": "Rollout backend",
    "async_rollout": "Asynchronous rollouts", "max_staleness": "Max staleness", "environment": "Environment",
    "tools": "Tools", "max_turns": "Max turns", "max_turn_tokens": "Tokens per turn", "dataset_dir": "Data folder",
    "dataset": "Datasets", "eval_dataset": "Eval datasets", "cutoff_len": "Cutoff length",
    "max_samples": "Max samples", "output_dir": "Output folder", "overwrite_output_dir": "Overwrite the run", "logging_steps": "Logging steps",
    "save_steps": "Save steps", "per_device_train_batch_size": "Batch size per worker",
    "gradient_accumulation_steps": "Gradient accumulation", "learning_rate": "Learning rate",
    "num_train_epochs": "Epochs", "max_steps": "Max steps", "lr_scheduler_type": "LR schedule",
    "warmup_steps": "Warmup steps", "bf16": "bf16", "seed": "Seed", "ray_num_workers": "Workers",
    "resources_per_worker": "CPUs per worker",
}
# Hub ids the model field suggests besides the built-in ones, with their chat template (the UI never
# downloads: one works once it is in this machine's hub cache). A test keeps each template registered.
HUB_MODELS = (
    ("Qwen/Qwen2.5-0.5B-Instruct", "qwen"), ("Qwen/Qwen2.5-1.5B-Instruct", "qwen"), ("Qwen/Qwen3-0.6B", "qwen3"),
    ("Qwen/Qwen3-1.7B", "qwen3"), ("meta-llama/Llama-3.2-1B-Instruct", "llama3"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama3"), ("mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
    ("google/gemma-2-2b-it", "gemma2"), ("google/gemma-3-1b-it", "gemma3"),
    ("microsoft/Phi-3-mini-4k-instruct", "phi"), ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
    ("Qwen/Qwen2-VL-2B-Instruct", "qwen2_vl"), ("llava-hf/llava-1.5-7b-hf", "llava"),
)
# Not fields (a run from the board always trains and plots): the extra keys a new form starts with.
NEW_FORM_EXTRA = {"do_train": True, "plot_loss": True}
REQUIRED_CHOICES = ("stage", "finetuning_type")  # every other select has a blank choice: "not written"
