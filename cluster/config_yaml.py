"""Reading a config's text: a YAML file or a dict, and ``key=value`` overrides.

Strict where PyYAML is lax: a key written twice is refused (PyYAML keeps the last), and only
true/false are booleans (YAML 1.1's yes/no/on/off stay words). Each mistake is a ConfigError
that names the file, the line or the override.
"""

from __future__ import annotations

import os
import re
import typing
from typing import Any

import yaml

from registries.datasets.errors import describe_type

from .config_types import ConfigError


def parse_override(text: str) -> tuple[str, Any]:
    """``lora_rank=16`` -> ("lora_rank", 16); the value is read as a YAML scalar (or flow list/map)."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ConfigError(
            f"command-line override {text!r} is not of the form key=value. Write overrides like "
            "lora_rank=16 or dataset=alpaca_en_demo,identity (no spaces around '=', no leading dashes)."
        )
    try:
        return key, load_yaml(value_text) if value_text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"command-line override {text!r}: the value is not valid YAML ({_yaml_problem(exc)}). "
            "Quote it, e.g. key='a: b'."
        ) from None


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int):
        self.key, self.first, self.second = key, first, second


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice (PyYAML would silently keep the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, typing.Hashable) and key in seen:
            raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
        if isinstance(key, typing.Hashable):
            seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.2 booleans: only true/false. PyYAML follows YAML 1.1, where yes/no/on/off are booleans
# too, so `save_strategy: no` would arrive as False and be refused. Words stay words; a boolean
# option still takes yes/no/on/off (config_types.coerce reads them).
_BOOL_TAG = "tag:yaml.org,2002:bool"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def read_source(path_or_dict: Any) -> tuple[dict[str, Any], dict[str, str], str]:
    if path_or_dict is None or isinstance(path_or_dict, dict):
        values, source = dict(path_or_dict or {}), "the config dict"
    elif isinstance(path_or_dict, (str, os.PathLike)):
        source = os.fspath(path_or_dict)
        values = _read_file(source)
    else:
        raise ConfigError(
            f"a config must be a YAML file path or a dict, got {type(path_or_dict).__name__}. "
            "Pass the path of your YAML file, or a dict of options."
        )
    bad = [k for k in values if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"key {bad[0]!r} in {source} is not a name. Option names are words like lora_rank.")
    return values, {key: source for key in values}, source


def _read_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file {path} not found (looked for {os.path.abspath(path)}). "
            "Check the path; relative paths start from the current directory."
        )
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = load_yaml(text)
    except _DuplicateKey as dup:
        raise ConfigError(
            f"key {dup.key!r} appears twice in {path} (lines {dup.first} and {dup.second}); "
            "YAML would silently keep only the last one. Delete one of them."
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(exc)}. Fix the file's syntax.") from None
    if data is None:
        raise ConfigError(f"config file {path} is empty. It needs at least model_name_or_path and output_dir.")
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must be a mapping of option: value lines, but its top level is "
            f"{describe_type(data)}. Write one option per line, e.g. lora_rank: 8."
        )
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem
