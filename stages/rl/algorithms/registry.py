"""The RL algorithms by name: advantage estimators, policy losses and KL estimators (verl's
``register_adv_est`` / ``register_policy_loss`` idea, with typed entries).

Each entry is one ``register_*`` call that names the implementation and states the facts the
config checks, the web UI's selects and docs/rl.md's table read: nothing else spells the names.
The built-in entries live in the modules BUILTIN_MODULES names; those import no torch at module
level, so a config is checked (and a typo in ``loss_type`` named) without importing torch. Lookups
load them on first use.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Literal, Optional, TypeVar

# The modules holding the built-in registrations, in the order their entries are listed.
BUILTIN_MODULES = ("stages.rl.algorithms.advantage_estimators", "stages.rl.algorithms.policy_losses",
                   "stages.rl.algorithms.kl_estimators", "stages.rl.algorithms.sapo")
# How a policy loss turns per-token losses into one number: the numerator, and the normalizer the
# whole optimizer step shares (``grpo_math.loss_normalizer``).
Aggregation = Literal["sequence_mean", "token_mean", "max_length"]
AGGREGATIONS: dict[str, str] = {
    "sequence_mean": "mean over each completion's tokens, then over completions",
    "token_mean": "mean over all tokens of the batch",
    "max_length": "sum over tokens / (completions x max_completion_length)",
}


class UnknownAlgorithm(ValueError):
    """A name no ``register_*`` call registered; the message lists the registered ones."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class DuplicateAlgorithm(ValueError):
    """A second ``register_*`` call for a name already taken."""


@dataclass(frozen=True)
class AdvantageEstimator:
    """``group``: flat advantages from rewards grouped [G, n] (``fn(grouped, scale_rewards, eps)``);
    ``per_token``: [B, T] advantages, ``fn(scores, kl, mask, kl_coef, num_generations, gamma)``;
    ``critic``: stage ppo's GAE from a critic's values (no ``fn``: the critic's loop computes it)."""

    name: str
    kind: Literal["group", "per_token", "critic"]
    summary: str
    fn: Optional[Callable[..., Any]] = None
    min_generations: int = 2  # completions per prompt it needs (num_generations)
    fixed_gamma: Optional[float] = None  # a discount the estimator forces (refused if gamma differs)

    @property
    def needs_critic(self) -> bool:
        return self.kind == "critic"


@dataclass(frozen=True)
class PolicyLoss:
    """``fn(ratio, adv, logp, epsilon_low, epsilon_high, **options)`` -> per-token loss [B, T];
    ``clip_bounds(epsilon_low, epsilon_high)`` -> (low, high) ratios beyond which a token counts as
    clipped (None: that side never clips); ``options``: the RLArguments keys ``fn`` also reads;
    ``check(rl)`` raises ``registries.errors.ArgumentError`` for a config the loss cannot run."""

    name: str
    summary: str
    fn: Callable[..., Any]
    aggregation: Aggregation
    clip_bounds: Callable[[float, float], tuple[Optional[float], Optional[float]]]
    options: tuple[str, ...] = ()
    check: Optional[Callable[[Any], None]] = None


@dataclass(frozen=True)
class KLEstimator:
    """``fn(log_ratio, clamp)`` -> per-token KL(policy || reference) estimate, log_ratio = logp - ref."""

    name: str
    summary: str
    fn: Callable[..., Any]


Entry = TypeVar("Entry", AdvantageEstimator, PolicyLoss, KLEstimator)


@dataclass
class Registry(Generic[Entry]):
    key: str  # the RLArguments key that picks an entry
    label: str
    entries: dict[str, Entry] = field(default_factory=dict)

    def register(self, entry: Entry) -> Entry:
        if entry.name in self.entries:
            raise DuplicateAlgorithm(f"{self.label} {entry.name!r} is already registered (by "
                                     f"{_origin(self.entries[entry.name])}); pick another name.")
        self.entries[entry.name] = entry
        return entry

    def names(self) -> tuple[str, ...]:
        load_builtins()
        return tuple(self.entries)

    def get(self, name: str) -> Entry:
        load_builtins()
        if name not in self.entries:
            raise UnknownAlgorithm(self.key, f"Unknown {self.label} {name!r} ({self.key}); expected one of "
                                             f"{', '.join(repr(n) for n in self.entries)}.")
        return self.entries[name]


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage_estimator", "advantage estimator")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("loss_type", "policy loss")
KL_ESTIMATORS: Registry[KLEstimator] = Registry("kl_estimator", "KL estimator")
REGISTRIES = (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS)
REGISTRY_BY_KEY = {r.key: r for r in REGISTRIES}


def _origin(entry) -> str:
    fn = getattr(entry, "fn", None)
    return getattr(fn, "__module__", None) or "an earlier registration"


def register_adv_est(name: str, kind: Literal["group", "per_token", "critic"], summary: str,
                     fn: Optional[Callable[..., Any]] = None, *, min_generations: int = 2,
                     fixed_gamma: Optional[float] = None) -> AdvantageEstimator:
    if (fn is None) != (kind == "critic"):
        need = "has no" if kind == "critic" else "needs a"
        raise ValueError(f"advantage estimator {name!r}: a {kind} estimator {need} fn.")
    return ADVANTAGE_ESTIMATORS.register(AdvantageEstimator(name, kind, summary, fn, min_generations, fixed_gamma))


def register_policy_loss(name: str, summary: str, fn: Callable[..., Any], *, aggregation: Aggregation,
                         clip_bounds: Callable[[float, float], tuple[Optional[float], Optional[float]]],
                         options: tuple[str, ...] = (), check: Optional[Callable[[Any], None]] = None) -> PolicyLoss:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"policy loss {name!r}: aggregation {aggregation!r} is not one of {tuple(AGGREGATIONS)}.")
    return POLICY_LOSSES.register(PolicyLoss(name, summary, fn, aggregation, clip_bounds, options, check))


def register_kl_estimator(name: str, summary: str, fn: Callable[..., Any]) -> KLEstimator:
    return KL_ESTIMATORS.register(KLEstimator(name, summary, fn))


_loaded = False


def load_builtins() -> None:
    """Import the modules of the built-in registrations (once; their entries register on import)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def choices(key: str) -> tuple[str, ...]:
    """The registered names of the registry an RLArguments key picks from (the web UI's select)."""
    return REGISTRY_BY_KEY[key].names()


def loss_options(rl) -> dict[str, Any]:
    """The RLArguments values the run's policy loss reads besides the epsilons (``PolicyLoss.options``)."""
    return {key: getattr(rl, key) for key in POLICY_LOSSES.get(rl.loss_type).options}


def check_algorithms(rl) -> None:
    """The names exist, and the chosen loss's and estimator's own rules hold (RLArguments.__post_init__,
    before epsilon_high defaults to epsilon). Raises ``registries.errors.ArgumentError``."""
    from registries.errors import ArgumentError

    for registry in REGISTRIES:
        try:
            registry.get(getattr(rl, registry.key))
        except UnknownAlgorithm as exc:
            raise ArgumentError(exc.key, f"{exc} Each is one register_* call (stages/rl/algorithms/registry.py); "
                                         "docs/rl.md lists them.") from None
    loss = POLICY_LOSSES.get(rl.loss_type)
    if loss.check is not None:
        loss.check(rl)
    estimator = ADVANTAGE_ESTIMATORS.get(rl.advantage_estimator)
    if estimator.fixed_gamma is not None and rl.gamma != estimator.fixed_gamma:
        raise ArgumentError(
            "gamma",
            f"advantage_estimator {estimator.name} discounts with gamma {estimator.fixed_gamma:g} only (it sums "
            f"each completion's centred score and KL over all later tokens, as OpenRLHF, which forces "
            f"gamma {estimator.fixed_gamma:g} for it), so gamma {rl.gamma} would be ignored; got gamma {rl.gamma}. "
            f"Remove gamma (or set gamma: {estimator.fixed_gamma:g}), or use advantage_estimator "
            "reinforce_plus_plus, whose returns do use gamma.",
        )


def check_for_stage(rl, stage) -> None:
    """The estimator's needs against the stage's table entry (a critic, completions per prompt), and
    GSPO's warning for a loss that is not a sequence mean."""
    from registries.errors import ArgumentError

    from stages.table import STAGES

    estimator = ADVANTAGE_ESTIMATORS.get(rl.advantage_estimator)
    if estimator.needs_critic and not stage.rl.critic:
        critics = ", ".join(s.name for s in STAGES.values() if s.rl is not None and s.rl.critic)
        others = [e.name for e in ADVANTAGE_ESTIMATORS.entries.values() if not e.needs_critic]
        raise ArgumentError(
            "advantage_estimator",
            f"advantage_estimator {estimator.name} needs a critic, which only stage {critics} trains; stage "
            f"{stage.name} compares completions of one prompt instead. Use {', '.join(others[:-1])} or {others[-1]}, "
            f"or stage {critics}.",
        )
    if rl.num_generations < estimator.min_generations:
        raise ArgumentError(
            "num_generations",
            f"advantage_estimator {estimator.name!r} compares the completions of one prompt with each other, so "
            f"num_generations must be at least {estimator.min_generations} (got {rl.num_generations}). "
            "Set num_generations: 4 (or more).",
        )
    if rl.importance_sampling_level == "sequence" and POLICY_LOSSES.get(rl.loss_type).aggregation != "sequence_mean":
        logging.getLogger("stages.rl.config.rl_args").warning(
            "importance_sampling_level sequence with loss_type %s sums per-token terms, so each completion weighs "
            "by its length; GSPO's own setup is loss_type grpo (as TRL warns).", rl.loss_type)


def markdown_table() -> str:
    """docs/rl.md's table of every registered algorithm and its facts (a test keeps the two equal)."""
    rows = ["| key | value | what it is | facts |", "|---|---|---|---|"]
    for e in ADVANTAGE_ESTIMATORS.names():
        est = ADVANTAGE_ESTIMATORS.get(e)
        facts = [{"group": "one advantage per completion", "per_token": "per token",
                  "critic": "per token, needs a critic (stage ppo)"}[est.kind],
                 f"num_generations >= {est.min_generations}"]
        if est.fixed_gamma is not None:
            facts.append(f"gamma {est.fixed_gamma:g} only")
        rows.append(f"| `advantage_estimator` | `{e}` | {est.summary} | {'; '.join(facts)} |")
    for name in POLICY_LOSSES.names():
        loss = POLICY_LOSSES.get(name)
        facts = [AGGREGATIONS[loss.aggregation]] + [f"reads `{o}`" for o in loss.options]
        rows.append(f"| `loss_type` | `{name}` | {loss.summary} | {'; '.join(facts)} |")
    for name in KL_ESTIMATORS.names():
        rows.append(f"| `kl_estimator` | `{name}` | {KL_ESTIMATORS.get(name).summary} | |")
    return "\n".join(rows)
