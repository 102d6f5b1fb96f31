"""Config values as YAML and the command line give them -> the types the dataclasses declare.

Also the one error type every config mistake becomes (``ConfigError``)."""

from __future__ import annotations

import difflib
import enum
import pathlib
import types
import typing
from typing import Any, Literal, Union

import yaml

from registries.datasets.errors import describe_type
from registries.errors import UserError


class ConfigError(UserError):
    """A mistake in the user's config. The message is meant to be shown as is, without a traceback;
    ``key`` is the config key it is about, where one is (the web UI marks that field)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key

    def __reduce__(self):  # picklable across Ray processes, key and all
        return (type(self), (str(self), self.key))


_BOOL_WORDS = {"yes": True, "on": True, "y": True, "no": False, "off": False, "n": False}


def bool_word(value: Any) -> Any:
    """yes/no/on/off (YAML 1.1's words for booleans; the config reader keeps them as words) as a
    bool; anything else as it is."""
    return _BOOL_WORDS.get(value.lower(), value) if isinstance(value, str) else value


class _Mismatch(Exception):
    def __init__(self, hint: str = ""):
        self.hint = hint


def coerce_key(key: str, value: Any, annotation: Any, where: str) -> Any:
    try:
        return coerce(value, annotation)
    except _Mismatch as exc:
        kind = "value" if _is_choice(annotation) else "type"
        hint = f"; {exc.hint}" if exc.hint else "."
        raise ConfigError(
            f"wrong {kind} for {key!r} in {where}: got {value!r} ({describe_type(value)}), "
            f"expected {describe(annotation)}{hint}"
        ) from None


def coerce(value: Any, ann: Any) -> Any:
    """``value`` as ``ann`` wants it. Numbers written as text ("1e-4", which YAML 1.1 reads as a
    string) become numbers and a comma-separated string becomes a list; nothing else is guessed."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is Any:
        return value
    if origin in (Union, types.UnionType):
        return _coerce_union(value, args)
    if origin is Literal:
        for choice in args:
            if value == choice and isinstance(value, bool) == isinstance(choice, bool):
                return choice
        raise _Mismatch(_suggest(value, args))
    if ann is type(None):
        if value is None:
            return None
        raise _Mismatch()
    if ann is list or origin is list:
        item = args[0] if args else Any
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        if not isinstance(value, (list, tuple)):
            raise _Mismatch()
        return [coerce(v, item) for v in value]
    if ann is dict or origin is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise _Mismatch() from None
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Mismatch()
        item = args[1] if len(args) == 2 else Any
        return {k: coerce(v, item) for k, v in value.items()}
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        members = [m.value for m in ann]
        if value in members:
            return value
        raise _Mismatch(_suggest(value, members))
    if ann is bool:
        if isinstance(value, bool):
            return value
        if bool_word(value) is not value:
            return bool_word(value)
    elif ann is int:
        return _as_number(value, integer=True)
    elif ann is float:
        return _as_number(value, integer=False)
    elif ann is str or ann is pathlib.Path:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # e.g. ray_run_name: 2024
    elif isinstance(ann, type):
        if isinstance(value, ann):
            return value
    else:
        return value
    raise _Mismatch()


def _coerce_union(value: Any, arms: tuple) -> Any:
    enum_arms = [a for a in arms if isinstance(a, type) and issubclass(a, enum.Enum)]
    if enum_arms:  # "SchedulerType | str": transformers turns the str into the enum, so check it now
        arms = tuple(a for a in arms if a is not str)
    hints = []
    for arm in arms:
        try:
            return coerce(value, arm)
        except _Mismatch as exc:
            hints.append(exc.hint)
    raise _Mismatch(next((h for h in hints if h), ""))


def _as_number(value: Any, integer: bool) -> int | float:
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in ".en") else int(value)
        except ValueError:
            raise _Mismatch() from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Mismatch()
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise _Mismatch()
        return int(value)
    return value  # an int is a fine float (num_train_epochs: 3); keeping it int keeps row counts exact


def _is_choice(ann: Any) -> bool:
    arms = typing.get_args(ann) if typing.get_origin(ann) in (Union, types.UnionType) else (ann,)
    return any(typing.get_origin(a) is Literal or (isinstance(a, type) and issubclass(a, enum.Enum)) for a in arms)


def describe(ann: Any) -> str:
    """An annotation in words, as an error message wants it."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (Union, types.UnionType):
        if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args):
            args = tuple(a for a in args if a is not str)
        return " or ".join(dict.fromkeys(describe(a) for a in args))
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in args)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        values = [m.value for m in ann]
        shown = ", ".join(repr(v) for v in values[:12])
        return f"one of {shown}" + (f" (and {len(values) - 12} more in {ann.__name__})" if len(values) > 12 else "")
    if ann is list or origin is list:
        item = args[0] if args else Any
        plural = {str: "strings", int: "integers", float: "numbers"}.get(item, "values")
        return f"a list of {plural} (or a comma-separated string)"
    if ann is dict or origin is dict:
        return "a mapping (e.g. {CPU: 1, GPU: 1})"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             pathlib.Path: "a path", type(None): "null", Any: "any value"}
    if ann in names:
        return names[ann]
    return f"a {getattr(ann, '__name__', ann)} object (which a config file cannot express)"


def _suggest(value: Any, choices: typing.Iterable[Any]) -> str:
    if not isinstance(value, str):
        return ""
    texts = [c for c in choices if isinstance(c, str)]
    same_case = [c for c in texts if c.lower() == value.lower()]
    close = same_case or difflib.get_close_matches(value, texts, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else ""
