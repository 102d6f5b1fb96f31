"""Where the web UI may read and write: the folder it runs in and its share dir, nothing else.

Every path a request names (a YAML to load or save, an export_dir, a dataset_dir, the output_dir
and local model paths of a config the UI checks, saves or starts) goes through ``confine``: taken
relative to the UI's folder, resolved with symlinks followed, and refused unless it lands inside
one of the allowed folders. Hub ids ("org/name") and the built-in ``tiny:``/``demo:`` ids are not
paths and pass as they are.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from registries.errors import ArgumentError

# Config keys that always name a local file or folder.
PATH_KEYS = ("dataset_dir", "output_dir", "export_dir", "tokenized_path", "deepspeed")
# Config keys that name a model or adapter: a local path or a hub / built-in id; "a,b" lists several.
MODEL_KEYS = ("model_name_or_path", "adapter_name_or_path", "ref_model", "ref_model_adapters",
              "reward_model", "reward_model_adapters", "resume_from_checkpoint")
NOT_PATHS = ("auto",)  # resume_from_checkpoint: auto is resolved by the run, inside output_dir


def confine(path: Any, roots: Sequence[str], key: str = "path") -> str:
    """The real absolute path of ``path`` (relative to ``roots[0]``), or an ArgumentError naming the
    allowed folders when it is not a path, or lies outside all of ``roots``."""
    where = " or ".join(roots)
    if not isinstance(path, str) or not path.strip():
        raise ArgumentError(key, f"{key}: a path is needed here (relative paths start at {roots[0]}).")
    if "\x00" in path:
        raise ArgumentError(key, f"{key} {path!r} is not a path.")
    real = os.path.realpath(os.path.join(roots[0], os.path.expanduser(path.strip())))
    for root in roots:
        top = os.path.realpath(root)
        if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
            return real
    raise ArgumentError(
        key, f"{key} {path!r} is outside the folders this web UI may use ({where}); it resolves to {real}. "
             f"Give a path inside one of them (relative paths start at {roots[0]}), or start "
             f"`rayfactory webui` from a folder that holds it.")


def is_local(value: str, cwd: str) -> bool:
    """A model value that names a filesystem path rather than a hub id ('name', 'org/name') or a
    built-in id (tiny:<family>, demo:<name>): absolute, ./ ../ ~, more than one /, a .. part, or
    something that exists under ``cwd``."""
    value = value.strip()
    if "://" in value or value.startswith(("tiny:", "demo:")) or value in NOT_PATHS:
        return False
    return (value.startswith(("/", "./", "../", "~", "\\")) or value in (".", "..") or value.count("/") > 1
            or "\\" in value or ".." in value.split("/") or os.path.lexists(os.path.join(cwd, value)))


def model_paths(value: Any) -> Iterable[str]:
    """The entries of a model key's value: one string, "a,b", or a list of strings."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return [v.strip() for v in value if isinstance(v, str) and v.strip()]
    return []


def check_config(config: dict[str, Any], roots: Sequence[str]) -> dict[str, Any]:
    """``config`` with its local paths resolved (for work done in this process, whatever its own
    folder); an ArgumentError naming the key when one leads outside ``roots``. What the UI saves or
    starts keeps the paths as written: a run starts in ``roots[0]``, where they mean the same."""
    resolved = dict(config)
    for key in PATH_KEYS:
        value = config.get(key)
        if value is None or value == "" or (key == "deepspeed" and isinstance(value, dict)):
            continue  # unset (the defaults are relative), or deepspeed given inline
        resolved[key] = confine(value, roots, key)
    for key in MODEL_KEYS:
        paths = model_paths(config.get(key))
        if any(is_local(p, roots[0]) for p in paths):
            resolved[key] = ",".join(confine(p, roots, key) if is_local(p, roots[0]) else p for p in paths)
    return resolved
