"""What an RL recipe is handed: its roles behind one interface, its prompts, and a step hook.

The recipe (stages/recipes/grpo.py) says *what* happens in a step; fabric/ decides *where* each role
runs (policy ranks and vLLM engines as Ray actors on placement groups) and implements
``RLRoles`` on top of them. Keeping the protocol here keeps stages free of placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional, Protocol, TypeVar

from stages.engines.types import Completion, SamplingSpec
from stages.rl.config.types import RolloutSample

if TYPE_CHECKING:
    from stages.job import JobSpec


R = TypeVar("R", covariant=True)


class Pending(Protocol, Generic[R]):
    """Work handed to the roles that has not been waited for (a call the actors queue in order)."""

    def done(self) -> bool:
        """True once the result is there (``result`` would not block)."""

    def result(self) -> R:
        """Wait for it; a failure in the actors is raised here."""


@dataclass
class Generation:
    """A batch's completions and, when the engines report it, the wall-clock span (``time.time``)
    they spent generating it: what tells how much of it overlapped the policy's work. Multi-turn
    episodes (stages/rl/controller/episodes.py) hand their trajectories instead."""

    completions: list[Completion]
    busy: Optional[tuple[float, float]] = None
    samples: Optional[list[RolloutSample]] = None  # multi-turn: the trajectories (completions is empty)
    version: Optional[int] = None  # multi-turn: the weights' version when its first turn was sent
    tokens_after_push: Optional[float] = None  # partial rollouts: share of tokens sampled after an in-flight push


class RLRoles(Protocol):
    policy_size: int  # data-parallel policy ranks; an update needs at least one sample each

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        """``sampling.n`` completions per prompt from the rollout backend (vLLM engines or HF)."""

    def generate_async(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> Pending[Generation]:
        """``generate`` without waiting: the work is queued behind the engines' earlier calls
        (generations and weight pushes run in the order they were sent)."""

    def policy_logprobs(self, samples: list[RolloutSample]) -> list[list[float]]:
        """The policy's current per-token log-probs of each completion (no gradient)."""

    def reference_logprobs(self, samples: list[RolloutSample]) -> list[list[float]]:
        """The frozen reference's per-token log-probs (only when beta > 0)."""

    def update(self, samples: list[RolloutSample], normalizer: float) -> dict[str, float]:
        """One optimizer step of the policy over the samples, split across its ranks; every part's
        loss is divided by the whole step's ``normalizer`` (grpo_math.loss_normalizer)."""

    def sync_weights(self) -> dict[str, float]:
        """Push the policy's weights into the rollout engines (a no-op for the HF backend)."""

    def push_weights(self) -> Pending[dict[str, float]]:
        """``sync_weights`` without waiting: every generation sent after it samples from these
        weights, every one sent before from the earlier ones."""

    def save(self, output_dir: str) -> None:
        """Write the trained adapter or model and the tokenizer into output_dir."""

    def save_checkpoint(self, folder: str) -> None:
        """Every learning role writes its weights, optimizer, schedule and RNG under ``folder``."""

    def load_checkpoint(self, folder: str) -> None:
        """The inverse of save_checkpoint, into roles that were just set up."""


class PPORoles(RLRoles, Protocol):
    """Stage ppo's extra roles: a critic (when advantage_estimator is gae) and a reward model."""

    def critic_values(self, samples: list[RolloutSample]) -> list[list[float]]:
        """The critic's value before each completion token."""

    def critic_update(self, samples: list[RolloutSample], normalizer: float) -> dict[str, float]:
        """One optimizer step of the critic's clipped value loss over a mini-batch."""

    def reward_scores(self, samples: list[RolloutSample]) -> list[float]:
        """The reward model's score of each completion (reward_model set)."""


@dataclass
class PromptRow:
    """One tokenized prompt: the template's ids up to the generation prompt, the reference
    answer as text (the dataset's response; "" when there is none), the dataset's extra columns,
    and the conversation as messages (what a multi-turn environment resets from)."""

    input_ids: list[int]
    prompt_text: str
    reference: str = ""
    columns: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    system: str = ""
    tools: str = ""  # JSON text of the row's function schemas, "" when none

    def environment_row(self) -> dict[str, Any]:
        """What ``Environment.reset`` gets: the extra columns, then the prompt turns, reference,
        system and tools under their own names (which win over a column of the same name)."""
        return {**self.columns, "prompt": self.messages, "reference": self.reference, "system": self.system,
                "tools": self.tools}


@dataclass
class RLRun:
    spec: "JobSpec"
    roles: RLRoles
    prompts: list[PromptRow]
    tokenizer: Any
    template: Any
    eval_prompts: list[PromptRow] = field(default_factory=list)
    on_log: Optional[Callable[[dict], None]] = None  # each logged record, for the console
    resume_from: Optional[str] = None  # a complete RL checkpoint folder to continue from
