"""Reward functions: a registry of built-ins, a loader for user functions, and weighted scoring.

A reward function follows TRL's calling convention, called with keywords only::

    fn(prompts=[...], completions=[...], reference=[...], completion_ids=[...], **extra_columns)
        -> list[float | None]   # one per completion

``prompts`` / ``completions`` are the texts; every other keyword is a list aligned with the
completions: ``reference`` (the row's reference answer, "" when it has none), ``completion_ids``
(token ids) and any other dataset column. A function that takes ``**kwargs`` gets every column;
one without gets only the columns it names. ``None`` means "does not apply to this completion":
it adds 0 to the total and is left out of that function's logged mean.

A spec (``reward_funcs`` in the config) is a built-in name or ``"module.path:function"``; the module
is imported on each worker, so it must be importable there (the repo root or the working dir).
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from registries.errors import UserError
from registries.unique import add_unique

from stages.rl.config.specs import importable_from, resolve_spec  # noqa: F401  (importable_from: used from here by fabric)

RewardFunc = Callable[..., Sequence[Optional[float]]]
REWARDS: dict[str, RewardFunc] = {}
SHORT_ANSWER_TOKENS = 32  # short_answer's scale: 0 reward at this many completion tokens


class RewardFunctionError(UserError):
    """A reward function that cannot be loaded or that misbehaved; the message names its spec."""


def register_reward(name: str, fn: RewardFunc) -> RewardFunc:
    """Make ``fn`` available as ``reward_funcs: [name]``; a second ``name`` is a ValueError."""
    if ":" in name or not name:
        raise ValueError(f"Reward name {name!r} must be non-empty and free of ':' (that marks module:function).")
    if not callable(fn):
        raise ValueError(f"Reward {name!r} must be callable, got {type(fn).__name__}.")
    return add_unique(REWARDS, name, fn, "Reward function")


def _need_references(name: str, reference: Sequence[str]) -> None:
    if reference and not any(ref.strip() for ref in reference):
        raise ValueError(f"{name} compares completions with the reference answer, but no row of this batch has "
                         "one; use a dataset with responses (the reference column) or another reward function")


def exact_match(prompts, completions, reference, **kwargs):
    """1.0 if the completion equals the reference (both stripped), else 0.0; None for a row without a
    reference (a batch with none at all is an error: the function could never apply)."""
    _need_references("exact_match", reference)
    return [None if not ref.strip() else float(c.strip() == ref.strip()) for c, ref in zip(completions, reference)]


def starts_with_answer(prompts, completions, reference, **kwargs):
    """1.0 if the stripped completion begins with the stripped reference (extra text after it is
    tolerated: an easy first step for a small model), else 0.0; None as in exact_match."""
    _need_references("starts_with_answer", reference)
    return [None if not ref.strip() else float(c.strip().startswith(ref.strip()))
            for c, ref in zip(completions, reference)]


_INTEGER = re.compile(r"[+-]?\d+")


def number_format(prompts, completions, **kwargs):
    """1.0 if the stripped completion is just an integer (e.g. "42", "-7"), else 0.0: a format check."""
    return [float(_INTEGER.fullmatch(c.strip()) is not None) for c in completions]


def digit_ratio(prompts, completions, **kwargs):
    """The share of the completion's non-space characters that are digits (0.0 when empty): a dense
    format signal for numeric answers, which even a random-init model climbs within tens of steps."""
    out = []
    for c in completions:
        chars = [ch for ch in c if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out


def final_number(prompts, completions, reference, **kwargs):
    """1.0 if the last integer in the completion equals the reference's, else 0.0; None as in
    exact_match. A graded check for a chatty model: "1 + 7 = 8" and "The answer is 8." both count,
    so a real instruct model that already answers some sums right gets a signal in every group,
    where exact_match (the bare number) gives it none."""
    _need_references("final_number", reference)
    out = []
    for c, ref in zip(completions, reference):
        wanted = _INTEGER.findall(ref)
        found = _INTEGER.findall(c)
        out.append(None if not wanted else float(bool(found) and int(found[-1]) == int(wanted[-1])))
    return out


def short_answer(prompts, completions, completion_ids, **kwargs):
    """1 - min(tokens / SHORT_ANSWER_TOKENS, 1): the shorter the completion, the better (learnt fast)."""
    return [1.0 - min(len(ids) / SHORT_ANSWER_TOKENS, 1.0) for ids in completion_ids]


def tool_use(prompts, completions, tool_calls):  # no **kwargs: a run without the column is told so
    """1.0 if the trajectory called a tool whose result came back (a multi-turn run's
    ``tool_calls`` column: environment: tools), else 0.0: the tool-call format signal."""
    return [float(calls > 0) for calls in tool_calls]


for _fn in (exact_match, starts_with_answer, final_number, number_format, digit_ratio, short_answer, tool_use):
    register_reward(_fn.__name__, _fn)


@dataclass
class RewardScores:
    """Scores of one batch: ``total`` the weighted sum per completion (None counted as 0) and
    ``per_function`` each function's raw values (None as NaN), keyed by ``names``."""

    total: list[float]
    per_function: dict[str, list[float]]
    names: list[str]

    def means(self) -> dict[str, float]:
        """Each function's mean over the completions it applied to (NaN if none), for logging."""
        out = {}
        for name, values in self.per_function.items():
            kept = [v for v in values if not math.isnan(v)]
            out[name] = sum(kept) / len(kept) if kept else math.nan
        return out


def _accepted_columns(fn: Callable) -> Optional[tuple[set[str], set[str]]]:
    """(parameters it accepts, those it requires), or None when it takes **kwargs / is opaque."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {p.name for p in named}, {p.name for p in named if p.default is p.empty}


@dataclass
class RewardSet:
    """Loaded reward functions with their weights; ``score`` runs them all on a batch."""

    specs: list[str]
    funcs: list[RewardFunc]
    weights: list[float]

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def _call(self, spec: str, fn: RewardFunc, kwargs: dict[str, Any], n: int) -> list[float]:
        accepted = _accepted_columns(fn)
        if accepted is not None:
            missing = accepted[1] - kwargs.keys()
            if missing:
                raise RewardFunctionError(
                    f"Reward function {spec!r} needs {sorted(missing)}, which this data does not provide; it can "
                    f"use {sorted(kwargs)}. Rename its parameters, give them defaults, or add the columns to the "
                    "dataset.")
            kwargs = {k: v for k, v in kwargs.items() if k in accepted[0]}
        try:
            values = fn(**kwargs)
        except Exception as exc:
            raise RewardFunctionError(
                f"Reward function {spec!r} raised {type(exc).__name__}: {exc}. It is called with keywords "
                "prompts, completions and the columns (lists aligned with completions) and must return one "
                "float (or None) per completion; fix the function or the data it reads.") from exc
        if hasattr(values, "tolist"):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise RewardFunctionError(
                f"Reward function {spec!r} returned {got} for {n} completions; it must return a list with one "
                "float (or None) per completion, in order.")
        out = []
        for i, v in enumerate(values):
            if v is None:
                out.append(math.nan)
            elif isinstance(v, numbers.Real) and math.isfinite(float(v)):
                out.append(float(v))
            else:
                raise RewardFunctionError(
                    f"Reward function {spec!r} returned {v!r} for completion {i}; each value must be a finite "
                    "number, or None when the function does not apply to that completion.")
        return out

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> RewardScores:
        """Run every function on the batch; ``columns`` (``reference``, ``completion_ids``, extras)
        are lists aligned with ``completions``."""
        n = len(completions)
        for key, col in {"prompts": prompts, **columns}.items():
            if len(col) != n:
                raise ValueError(f"Reward column {key!r} has {len(col)} entries for {n} completions.")
        kwargs = {**columns, "prompts": prompts, "completions": completions}
        per_function = {spec: self._call(spec, fn, kwargs, n) for spec, fn in zip(self.specs, self.funcs)}
        total = [0.0] * n
        for spec, weight in zip(self.specs, self.weights):
            for i, value in enumerate(per_function[spec]):
                if not math.isnan(value):  # None (NaN here): the function does not apply, adds nothing
                    total[i] += weight * value
        return RewardScores(total=total, per_function=per_function, names=self.names)


def _resolve(spec: str, run_module: bool = True) -> Optional[RewardFunc]:
    """The function ``spec`` names (specs.resolve_spec's rules; None: a user module found, not run)."""
    return resolve_spec(spec, REWARDS, "reward function", RewardFunctionError,
                        "Point the spec at a function fn(prompts, completions, **columns) -> list[float].", run_module)


def load_reward_funcs(specs: list[str], weights: Optional[list[float]] = None, run_modules: bool = True) -> RewardSet:
    """Resolve each spec (built-in name or "module.path:function"); weights default to 1.0 each.
    ``run_modules`` False checks user modules by finding their files only (``rayfactory submit``)."""
    if not specs:
        raise RewardFunctionError("No reward functions given: set reward_funcs, e.g. [exact_match].")
    if len(set(specs)) != len(specs):
        dupes = sorted({s for s in specs if specs.count(s) > 1})
        raise RewardFunctionError(f"reward_funcs lists {dupes} more than once; list each once and use "
                                  "reward_weights to weigh it.")
    if weights is None:
        weights = [1.0] * len(specs)
    if len(weights) != len(specs):
        raise RewardFunctionError(f"{len(weights)} reward_weights for {len(specs)} reward_funcs; give one each.")
    return RewardSet(specs=list(specs), funcs=[_resolve(s, run_modules) for s in specs], weights=[float(w) for w in weights])
