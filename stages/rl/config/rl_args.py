"""The RL options of a run (TRL's GRPO key names where TRL has them) and the rollout engines'.
Sampling (``temperature``, ``top_p``, ``top_k``) is the generating options', as in LLaMA-Factory
and TRL; ``max_completion_length`` caps each completion."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional

from registries.errors import ArgumentError

from stages.rl.algorithms import registry

logger = logging.getLogger(__name__)

# Stage ppo's defaults where they differ from grpo's (applied when the config does not set the key):
# a critic and GAE, one completion per prompt, the KL as a per-token k1 penalty in the reward with
# TRL's initial coefficient 0.2 (LLaMA-Factory's PPO runs on TRL 0.9 with these).
PPO_DEFAULTS = {"advantage_estimator": "gae", "num_generations": 1, "kl_estimator": "k1", "beta": 0.2}


def default_correction(asynchronous: bool) -> bool:
    """Whether correction is on when the config does not say (``vllm_importance_sampling_correction``
    left unset). The hook for asynchronous rollouts: with samples from older weights the mismatch is
    real and NeMo-RL calls the correction required for convergence (TRL turns it on by default), so
    an asynchronous run gets it; the synchronous loop, whose engines hold the weights being trained,
    keeps its exact historical update. Callers pass whether the run's rollouts are asynchronous."""
    return asynchronous


@dataclass
class RLArguments:
    # --- rollouts -------------------------------------------------------------------------------
    rollout_batch_size: int = 8  # prompts per step; each gets num_generations completions
    num_generations: int = 4  # completions per prompt (a group)
    max_completion_length: int = 32  # tokens per completion (multi-turn: the whole trajectory)
    rollout_backend: Literal["vllm", "hf"] = "vllm"  # hf: transformers generate() inside the policy workers
    # Asynchronous rollouts (stages/rl/controller/rollouts.py): off, today's synchronous step; one_step,
    # the engines generate the next batch while the policy trains on this one (samples one version
    # old, verl's one-step-off); bounded, up to max_staleness batches ahead (versions old).
    async_rollout: Literal["off", "one_step", "bounded"] = "off"
    max_staleness: Optional[int] = None  # None: 0 when off, 1 for one_step, 2 for bounded
    # Partial rollouts (verl's partial_rollout): when asynchronous, a weight push is loaded by the
    # engines between two decoding steps of the generation in flight instead of after it; the tokens
    # still to come are sampled by the new weights (stages/engines/inflight_weights.py).
    partial_rollout: bool = False
    # --- multi-turn rollouts (stages/rl/controller/episodes.py) ---------------------------------------------
    # An environment makes each rollout a conversation: the policy's turns and the environment's
    # observations (tool results) until an answer, max_turns, or max_completion_length, which caps
    # the whole trajectory (sampled and observation tokens: what the policy trains on).
    environment: Optional[str] = None  # "tools" (built-in) or "module.path:Class"; None: tools if listed
    environment_kwargs: dict[str, Any] = field(default_factory=dict)  # a custom environment's arguments
    tools: list[str] = field(default_factory=list)  # built-ins calculator, python; or "module.path:tool"
    max_turns: int = 4  # policy turns per trajectory
    max_turn_tokens: Optional[int] = None  # one policy turn's cap; None: max_completion_length
    # The python tool's sandbox (stages/rl/agents/sandbox.py): isolated, or the run is refused where a piece
    # of the isolation cannot be enforced; unisolated runs the policy's programs without it (warned).
    sandbox: Literal["isolated", "unisolated"] = "isolated"
    # --- rewards --------------------------------------------------------------------------------
    # "module.path:function" or a built-in name (stages/rl/controller/rewards.py); one float per completion.
    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: Optional[list[float]] = None  # None: 1.0 each
    # --- advantages and loss (estimators and losses: registered names, stages/rl/algorithms/registry.py) ---
    advantage_estimator: str = "group_norm"  # gae: stage ppo's critic-based estimator
    scale_rewards: Literal["group", "batch", "none"] = "group"  # group_norm's std: per group, whole batch, none
    # KL-to-reference weight; 0 loads no reference model at all. grpo adds it to the loss; ppo puts
    # the KL into the reward, per token, and beta is the KL controller's starting coefficient.
    beta: float = 0.0
    kl_estimator: str = "k3"  # k1, k2 or k3 (Schulman's); registered names, stages/rl/algorithms/registry.py
    epsilon: float = 0.2  # clip range of the probability ratio ...
    epsilon_high: Optional[float] = None  # ... and its upper side (DAPO's clip-higher); None: epsilon
    loss_type: str = "dapo"  # grpo (sequence mean), dapo (token mean), dr_grpo, cispo, sapo, ...
    sapo_temperature_pos: float = 1.0  # loss_type sapo's gate temperature where A > 0 (TRL's default) ...
    sapo_temperature_neg: float = 1.05  # ... and where A <= 0 (stages/rl/algorithms/sapo.py)
    # sequence: GSPO's one ratio per completion, exp(mean token log-ratio), clipped as a whole.
    importance_sampling_level: Literal["token", "sequence"] = "token"
    entropy_coef: float = 0.0  # loss -= entropy_coef x token entropy, aggregated as the policy loss
    # DAPO's soft overlong punishment: up to -overlong_penalty_factor added to the reward, linearly
    # over the last overlong_buffer_len tokens before max_completion_length; 0 turns it off.
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0  # see overlong_buffer_len
    num_iterations: int = 1  # policy updates per rollout batch (TRL's mu)
    # Micro-batches of the policy's and critic's passes (update, log-probs, reference, values) by a
    # budget of tokens instead of per_device_train_batch_size rows: verl's per-GPU token cap. Padded
    # tokens (rows x the longest), or real ones when the passes are padding-free (the data key
    # padding_free, docs/rl.md). The gradient does not depend on the split. None: by rows.
    max_tokens_per_micro_batch: Optional[int] = None
    # Drop prompt groups whose completions all got the same reward (no signal); the kept share is logged.
    dynamic_filtering: bool = False
    # DAPO's dynamic sampling (verl's filter_groups.max_num_gen_batches): with dynamic_filtering,
    # generate up to this many prompt batches a step, refilling until rollout_batch_size groups
    # with a signal are kept (1: only drop, the batch shrinks).
    max_num_gen_batches: int = 1
    # --- rollout correction (stages/rl/algorithms/rollout_correction.py; TRL's keys, for either backend) ---
    # Importance weights between the trainer's log-probs and the sampler's. None: decided by
    # default_correction (above), off for today's synchronous loop.
    vllm_importance_sampling_correction: Optional[bool] = None
    # None: sequence_mask (TRL's default) for the synchronous loop, token_truncate (verl's and
    # NeMo-RL's TIS) for asynchronous rollouts, whose stale samples it trains on best here
    # (benchmarks/README.md, "Asynchronous rollouts").
    vllm_importance_sampling_mode: Optional[Literal["token_truncate", "token_mask", "sequence_truncate",
                                                    "sequence_mask"]] = None
    vllm_importance_sampling_clip_max: Optional[float] = 3.0  # None: no upper bound
    vllm_importance_sampling_clip_min: Optional[float] = None  # None: no lower bound
    vllm_importance_sampling_cap: Optional[float] = None  # TRL's deprecated name of clip_max
    # --- PPO (stage ppo; LLaMA-Factory's key names where it has them) ---------------------------
    ppo_epochs: int = 4  # passes over each rollout batch
    ppo_buffer_size: int = 1  # mini-batches per rollout batch: one optimizer step of each role apiece
    ppo_target: float = 6.0  # the adaptive KL controller's target KL per completion
    adaptive_kl: bool = True  # false: beta stays fixed
    kl_horizon: int = 10000  # completions over which the adaptive coefficient may move by +-20%
    ppo_score_norm: bool = False  # scores divided by a running std after a running mean is taken off
    ppo_whiten_rewards: bool = False  # whiten the per-token rewards (keeping their mean) before GAE
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    cliprange_value: Optional[float] = 0.2  # the critic's values move at most this far from the rollout's; None: unclipped
    # The critic (a causal LM + value head) starts from the reward model ("reward": its weights and
    # head, OpenRLHF's default) or from the policy ("policy": a fresh head). None: reward when
    # reward_model is set, else policy.
    critic_init: Optional[Literal["reward", "policy"]] = None
    critic_learning_rate: Optional[float] = None  # None: learning_rate
    # --- rollout engines (vLLM) -----------------------------------------------------------------
    vllm_kv_cache_gib: float = 0.25  # KV cache per engine; on CPU it must be set (the default takes RAM)
    vllm_enforce_eager: bool = True  # skip graph capture / torch.compile (~40 s on CPU)
    # How a LoRA policy reaches the engines after each step: merged into a full copy of the weights
    # (any engine), or the adapter alone, served by vLLM's LoRA support beside an untouched base
    # (bytes per push scale with the adapter; stages/engines/vllm_adapters.py).
    rollout_lora_sync: Literal["merged", "adapter"] = "merged"
    # How full (or merged) weights travel to the engines after each step: through the Ray object
    # store as safetensors bytes, or broadcast from the policy's rank 0 in buckets over a process
    # group of their own (gloo on CPU, NCCL on GPU; fabric/weight_sync.py).
    rollout_weight_sync: Literal["object_store", "collective"] = "object_store"
    vllm_max_model_len: Optional[int] = None  # None: cutoff_len + max_completion_length
    # GPU share an engine may take; None: vLLM's 0.9 on bundles of its own, 0.4 when colocated with
    # the policy (vLLM checks at start that this much of the GPU is free, after the policy loaded).
    vllm_gpu_memory_utilization: Optional[float] = None
    # --- remote reward API (reward_model_type: api; stages/rl/controller/remote_reward.py) -------------------
    # How the controller calls the reward server (or LLM judge) at reward_model's URL: seconds per
    # attempt (the whole reply), retries after the first attempt (with exponential backoff, on
    # connection errors, timeouts, HTTP 429/5xx), requests in flight at once, and completions per
    # request to a reward server (a judge gets one request per completion).
    reward_api_timeout: float = 30.0
    reward_api_retries: int = 3  # see reward_api_timeout
    reward_api_concurrency: int = 8  # see reward_api_timeout
    reward_api_batch_size: int = 32  # see reward_api_timeout
    # An LLM judge (reward_model an OpenAI-style .../chat/completions URL): the rubric sent for each
    # completion, with {prompt}, {completion} and {reference} filled in, asking for "Score: N"
    # (None: the built-in 0-10 rubric); the served model to ask (None: the first the server lists);
    # the score that maps to reward 1 (replies are scaled to [0, 1]).
    reward_judge_rubric: Optional[str] = None
    reward_judge_model: Optional[str] = None  # see reward_judge_rubric
    reward_judge_max_score: float = 10.0  # see reward_judge_rubric

    def __post_init__(self) -> None:
        for name in ("rollout_batch_size", "num_generations", "max_completion_length", "num_iterations", "ppo_epochs",
                     "ppo_buffer_size", "kl_horizon", "max_tokens_per_micro_batch", "max_num_gen_batches",
                     "reward_api_concurrency", "reward_api_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ArgumentError(name, f"{name} must be at least 1, got {getattr(self, name)}.")
        self._check_loss_variants()
        self._check_multi_turn()
        self._check_async_rollout()
        self._check_rollout_correction()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.epsilon <= 0 or self.epsilon_high <= 0:
            raise ArgumentError("epsilon", f"epsilon and epsilon_high must be positive, got {self.epsilon}, "
                                           f"{self.epsilon_high}.")
        if self.beta < 0:
            raise ArgumentError("beta", f"beta must be >= 0 (0 turns the KL term off), got {self.beta}.")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ArgumentError(
                "reward_weights",
                f"reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs; "
                "give one weight per function, in the same order, or remove reward_weights.",
            )
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ArgumentError("gamma", f"gamma and lam must lie in [0, 1], got gamma {self.gamma}, lam {self.lam}.")
        if self.ppo_target <= 0:
            raise ArgumentError("ppo_target", f"ppo_target (the target KL) must be positive, got {self.ppo_target}.")
        if self.vllm_kv_cache_gib <= 0:
            raise ArgumentError("vllm_kv_cache_gib", f"vllm_kv_cache_gib must be positive, got {self.vllm_kv_cache_gib}.")
        self._check_reward_api()

    def _check_reward_api(self) -> None:
        """The remote reward API's client options (reward_model_type: api)."""
        if not self.reward_api_timeout > 0:
            raise ArgumentError("reward_api_timeout", f"reward_api_timeout (seconds per attempt at the reward API) "
                                                      f"must be positive, got {self.reward_api_timeout}. E.g. 30.")
        if self.reward_api_retries < 0:
            raise ArgumentError("reward_api_retries", f"reward_api_retries (attempts after the first) must be >= 0, "
                                                      f"got {self.reward_api_retries}. E.g. 3; 0 never retries.")
        if self.reward_judge_rubric is not None and "{completion}" not in self.reward_judge_rubric:
            raise ArgumentError(
                "reward_judge_rubric",
                "reward_judge_rubric has no {completion} placeholder, so the judge would never see the answer it "
                "grades. Write the rubric with {completion} where the answer goes (and {prompt}, {reference} if "
                "wanted), asking for one line \"Score: N\".",
            )
        if not self.reward_judge_max_score > 0:
            raise ArgumentError("reward_judge_max_score", f"reward_judge_max_score (the judge's top score, which "
                                f"maps to reward 1) must be positive, got {self.reward_judge_max_score}. E.g. 10.")

    def _check_loss_variants(self) -> None:
        """The registered algorithms' rules, the entropy bonus, the overlong buffer; before epsilon_high is set."""
        registry.check_algorithms(self)
        if self.entropy_coef < 0:
            raise ArgumentError(
                "entropy_coef",
                f"entropy_coef must be >= 0, got {self.entropy_coef}: it is the weight of an entropy bonus that "
                "keeps the policy exploring (loss -= entropy_coef x entropy); a negative one would push entropy "
                "down. Use 0 (off) or a small value such as 0.001.",
            )
        if self.overlong_buffer_len < 0 or self.overlong_buffer_len >= self.max_completion_length:
            raise ArgumentError(
                "overlong_buffer_len",
                f"overlong_buffer_len is how many tokens before max_completion_length the soft overlong penalty "
                f"starts, so it must lie in [0, max_completion_length) = [0, {self.max_completion_length}); got "
                f"{self.overlong_buffer_len}. Use 0 to turn the penalty off, or e.g. a quarter of "
                "max_completion_length (DAPO used 4096 of 20480).",
            )
        if self.overlong_penalty_factor < 0:
            raise ArgumentError(
                "overlong_penalty_factor",
                f"overlong_penalty_factor is the largest penalty (at max_completion_length) subtracted from the "
                f"reward, so it must be >= 0; got {self.overlong_penalty_factor}. DAPO uses 1.0.",
            )

    def _check_multi_turn(self) -> None:
        """An environment and its tools agree; turn caps are positive and fit the trajectory."""
        if self.tools and self.environment is None:
            self.environment = "tools"
        if self.environment == "tools" and not self.tools:
            raise ArgumentError(
                "tools",
                "environment tools runs the tools the policy calls, but tools lists none. Add e.g. tools: "
                "[calculator] (built-ins: calculator, python) or tools: [my_module:my_tool].",
            )
        if self.environment not in (None, "tools") and self.tools:
            raise ArgumentError(
                "tools",
                f"tools {self.tools} are run by the built-in environment tools, but environment is "
                f"{self.environment!r}, which lists its own tools (its tools attribute). Remove tools, or set "
                "environment: tools.",
            )
        if self.environment_kwargs and self.environment in (None, "tools"):
            raise ArgumentError(
                "environment_kwargs",
                "environment_kwargs are the arguments of a custom environment (environment: module.path:Class); "
                f"with environment {self.environment!r} nothing would read them. Remove them or name your class.",
            )
        if self.sandbox == "unisolated":
            logger.warning("sandbox: unisolated: the python tool will run the policy's programs WITHOUT isolation "
                           "(they can read and write whatever the run can); remove the key to isolate them.")
        for name in ("max_turns", "max_turn_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ArgumentError(name, f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_turn_tokens is not None and self.max_turn_tokens > self.max_completion_length:
            raise ArgumentError(
                "max_turn_tokens",
                f"max_turn_tokens {self.max_turn_tokens} caps one policy turn, but max_completion_length "
                f"{self.max_completion_length} caps the whole trajectory (every turn and observation), so a turn "
                "could never use it. Lower max_turn_tokens or raise max_completion_length.",
            )

    @property
    def multi_turn(self) -> bool:
        return self.environment is not None

    def _check_async_rollout(self) -> None:
        """max_staleness agrees with the mode; the engines must be separate from the policy."""
        implied = {"off": 0, "one_step": 1, "bounded": 2}[self.async_rollout]
        if self.max_staleness is None:
            self.max_staleness = implied
        elif self.async_rollout in ("off", "one_step") and self.max_staleness != implied:
            raise ArgumentError(
                "max_staleness",
                f"async_rollout {self.async_rollout} trains on samples exactly {implied} version(s) old, so "
                f"max_staleness {self.max_staleness} does not apply. Remove max_staleness, or set "
                "async_rollout: bounded to let the engines run up to max_staleness batches ahead.",
            )
        elif self.async_rollout == "bounded" and self.max_staleness < 1:
            raise ArgumentError(
                "max_staleness",
                f"async_rollout bounded lets the engines run up to max_staleness batches ahead of the policy, so "
                f"it must be at least 1 (1 is one_step); got {self.max_staleness}. verl and AReaL use 1 to 4.",
            )
        if self.partial_rollout and self.async_rollout == "off":
            raise ArgumentError(
                "partial_rollout",
                "partial_rollout loads a weight push into the engines while they are still generating, but with "
                "async_rollout off the loop pushes only after every generation has finished, so there is nothing "
                "to interrupt. Set async_rollout: one_step (or bounded), or remove partial_rollout.",
            )
        if self.async_rollout != "off" and self.rollout_backend == "hf":
            raise ArgumentError(
                "async_rollout",
                f"async_rollout {self.async_rollout} overlaps generation with the policy's update, but with "
                "rollout_backend hf the policy workers generate themselves, so the two would only take turns. "
                "Set rollout_backend: vllm (engines of their own), or async_rollout: off.",
            )

    @property
    def asynchronous(self) -> bool:
        return self.async_rollout != "off"

    def _check_rollout_correction(self) -> None:
        """TRL's rules for the vllm_importance_sampling_* keys, plus positive bounds."""
        self.correction_by_default = self.vllm_importance_sampling_correction is None  # for error messages
        if self.correction_by_default:
            self.vllm_importance_sampling_correction = default_correction(self.asynchronous)
        if self.vllm_importance_sampling_mode is None:
            self.vllm_importance_sampling_mode = "token_truncate" if self.asynchronous else "sequence_mask"
        if self.vllm_importance_sampling_cap is not None:  # as TRL: the old name sets clip_max
            logger.warning("vllm_importance_sampling_cap is TRL's deprecated name; use "
                           "vllm_importance_sampling_clip_max (set from it now).")
            self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_cap = (
                self.vllm_importance_sampling_cap, None)
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        for name, bound in (("vllm_importance_sampling_clip_min", low), ("vllm_importance_sampling_clip_max", high)):
            if bound is not None and bound <= 0:
                raise ArgumentError(
                    name,
                    f"{name} bounds the importance ratio (trainer / sampler probability), which is always positive, "
                    f"so it must be above 0 or unset (no bound on that side); got {bound}. TRL's default is "
                    "clip_max 3.0 with no clip_min.",
                )
        if low is not None and high is not None and low >= high:
            raise ArgumentError(
                "vllm_importance_sampling_clip_min",
                f"vllm_importance_sampling_clip_min ({low}) must be less than vllm_importance_sampling_clip_max "
                f"({high}): they are the lower and upper bounds of the importance ratio. E.g. clip_min 0.5 with "
                "clip_max 2.0, or leave clip_min unset.",
            )
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("truncate")
                and low is None and high is None):
            raise ArgumentError(
                "vllm_importance_sampling_clip_max",
                f"vllm_importance_sampling_mode {self.vllm_importance_sampling_mode} truncates the importance ratio "
                "to [clip_min, clip_max], but both bounds are unset, so nothing would bound it (as TRL, this is "
                "refused). Set vllm_importance_sampling_clip_max (TRL's default 3.0) or clip_min.",
            )

    def check_for_stage(self, stage) -> None:
        """Rules that depend on the stage's entry in the stage table (an RL stage's)."""
        registry.check_for_stage(self, stage)  # the estimator's critic and group size, GSPO's loss
        from stages.table import stages_where  # the table says whose loop filters groups
        filtering = stages_where("rl.filters_groups")  # for the refusals' wording
        if self.dynamic_filtering and not stage.rl.filters_groups:  # ppo's loop trains on every group
            raise ArgumentError(
                "dynamic_filtering",
                "dynamic_filtering drops the prompt groups whose completions all got the same reward, which only "
                f"stage {filtering} does; stage {stage.name} trains on every group, so the key would do nothing. "
                f"Remove dynamic_filtering (or set it to false), or use stage: {filtering}.",
            )
        if self.dynamic_filtering and self.num_generations < 2:  # reinforce_plus_plus allows a single completion
            raise ArgumentError(
                "dynamic_filtering",
                "dynamic_filtering drops prompt groups whose completions all got the same reward, and a group of "
                f"num_generations {self.num_generations} always does, so every step would be skipped. Set "
                "num_generations: 2 or more, or dynamic_filtering: false.",
            )
        if self.max_num_gen_batches > 1 and not (self.dynamic_filtering and stage.rl.filters_groups):
            raise ArgumentError(
                "max_num_gen_batches",
                f"max_num_gen_batches {self.max_num_gen_batches} refills the batches that dynamic_filtering "
                f"shrinks (stage {filtering}), but {'dynamic_filtering is off' if self.dynamic_filtering else 'this is stage ' + stage.name}. "
                f"Set dynamic_filtering: true under stage {filtering}, or remove max_num_gen_batches.",
            )
        # reward functions are its only scorer, but a custom environment's step rewards (built-in tools: none)
        if not stage.rl.reward_model and not self.reward_funcs and self.environment in (None, "tools"):
            raise ArgumentError(
                "reward_funcs",
                f"stage {stage.name} needs reward_funcs: a list of reward functions, e.g. reward_funcs: "
                "[exact_match] or [my_rewards:score] (a module on the Python path and a function in it); "
                "or a custom environment (environment: module.path:Class) whose step() rewards score alone.",
            )

    @property
    def uses_critic(self) -> bool:
        return registry.ADVANTAGE_ESTIMATORS.get(self.advantage_estimator).needs_critic

    @property
    def completions_per_step(self) -> int:
        return self.rollout_batch_size * self.num_generations


def ppo_defaults(given: Mapping[str, Any], training, ray_args, generating) -> dict[str, Any]:
    """Stage ppo's RL defaults for the keys the config leaves out (``given``: the keys it sets), and
    LLaMA-Factory's way of sizing a PPO step: per_device_train_batch_size x gradient_accumulation_steps
    x ppo_buffer_size prompts per worker, answered max_new_tokens long."""
    defaults = {key: value for key, value in PPO_DEFAULTS.items() if key not in given}
    if "rollout_batch_size" not in given:
        per_worker = int(training.per_device_train_batch_size) * int(training.gradient_accumulation_steps)
        buffer = int(given.get("ppo_buffer_size", RLArguments.ppo_buffer_size))
        defaults["rollout_batch_size"] = per_worker * buffer * ray_args.ray_num_workers
    if "max_completion_length" not in given and "max_new_tokens" in given:
        defaults["max_completion_length"] = int(generating.max_new_tokens)
    return defaults
