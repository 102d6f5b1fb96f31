"""Where the web UI may read and write: the folder it runs in and its share dir, nothing else.

Every path a request names (a YAML to load or save, an export_dir, a dataset_dir, the output_dir
and local model paths of a config the UI checks, saves or starts) goes through ``confine``: taken
relative to the UI's folder, resolved with symlinks followed, and refused unless it lands inside
one of the allowed folders. Hub ids ("org/name") and the built-in ``tiny:``/``demo:`` ids are not
paths and pass as they are.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from registries.errors import ArgumentError

# A config key whose name ends like these holds a local file or folder. path_keys() reads every key of
# the typed config (cluster/config.py's key_owners) through this, so a field added later is confined
# too; tests/webui/test_hardening.py tries each key the rule finds with a path outside the UI's folders.
PATH_NAME = re.compile(r"(?:^|_)(?:dir|path|file|folder|checkpoint|adapters)$|^deepspeed$|_config$")
# Keys that name a model or adapter: a local path or a hub / built-in id; "a,b" lists several.
MODEL_KEYS = ("model_name_or_path", "adapter_name_or_path", "ref_model", "ref_model_adapters",
              "reward_model", "reward_model_adapters", "adapters")
NOT_PATHS = ("auto",)  # resume_from_checkpoint: auto is resolved by the run, inside output_dir
# Remote storage Ray Train writes checkpoints to (pyarrow file systems): not a local path.
STORAGE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "abfs", "abfss", "az")


@lru_cache(maxsize=1)
def path_keys() -> tuple[str, ...]:
    """Every config key whose name says it holds a local file or folder (PATH_NAME) and whose type
    takes a string, model keys aside (a switch such as restore_callback_states_from_checkpoint is no path)."""
    import typing

    from ..config import key_annotation, key_owners

    def takes_text(annotation: Any) -> bool:
        return annotation is str or annotation is Any or any(takes_text(a) for a in typing.get_args(annotation))

    return tuple(sorted(key for key, group in key_owners().items()
                        if PATH_NAME.search(key) and key not in MODEL_KEYS and takes_text(key_annotation(group, key))))


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


HUB_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?(?:/[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?)?")
BUILT_IN = re.compile(r"(?:tiny|demo):[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def is_local(value: str, cwd: str) -> bool:
    """Whether a model value names a filesystem path. Only two spellings are not paths: a built-in id
    (tiny:<family>, demo:<name>) and a hub id as the hub spells them ('name', 'org/name': letters,
    digits, '-', '_', '.', no '..' or '--') that names nothing under ``cwd``. Anything else ('x://..',
    'file:///etc', 'a:b', 'org/'), and a hub spelling that exists here, is a path: confined like one,
    so a local folder is never reached through a spelling taken for an id."""
    value = value.strip()
    if value in NOT_PATHS or BUILT_IN.fullmatch(value):
        return False
    hub_id = HUB_ID.fullmatch(value) and ".." not in value and "--" not in value and value not in (".",)
    return not hub_id or os.path.lexists(os.path.join(cwd, value))


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
    for key in path_keys():
        value = config.get(key)
        if value is None or value == "" or isinstance(value, (bool, dict)) or value in NOT_PATHS:
            continue  # unset (the defaults are relative), a switch (resume: true), or settings given inline
        if key == "ray_storage_path" and isinstance(value, str) and value.split("://")[0] in STORAGE_SCHEMES \
                and "://" in value:
            continue  # remote storage, written by the job (the config asks for the network)
        if isinstance(value, list):
            resolved[key] = [confine(v, roots, key) for v in value]
        else:
            resolved[key] = confine(value, roots, key)
    for key in MODEL_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # adapters: {name: folder}
            resolved[key] = {name: _model_path(p, roots, key) for name, p in value.items()}
            continue
        paths = model_paths(value)
        if any(is_local(p, roots[0]) for p in paths):
            resolved[key] = ",".join(_model_path(p, roots, key) for p in paths)
    return resolved


def _model_path(value: Any, roots: Sequence[str], key: str) -> Any:
    """A model value resolved when it is a local path (confined), else as it is (a hub or built-in id)."""
    return confine(value, roots, key) if not isinstance(value, str) or is_local(value, roots[0]) else value


def check_loadable_here(config: dict[str, Any], roots: Sequence[str]) -> None:
    """The model and adapter of a Chat or Export request can be loaded in this process without the
    network: a local folder that exists (an adapter's with its adapter_config.json), a built-in model
    id, or a hub id already in this machine's hub cache. The UI itself never downloads; an ArgumentError
    naming the key says what to give instead."""
    for key, wanted in (("model_name_or_path", "config.json"), ("adapter_name_or_path", "adapter_config.json")):
        value = config.get(key)
        if isinstance(value, str) and value.strip() and "" in [v.strip() for v in value.split(",")]:
            raise ArgumentError(key, f"{key} {value!r} has an empty entry; list folders as a,b.")
        for value in model_paths(value):
            what = "an adapter folder (one holding adapter_config.json)" if wanted != "config.json" else \
                "a model folder (one holding config.json)"
            if is_local(value, roots[0]):
                if not os.path.isfile(os.path.join(value, wanted)):
                    raise ArgumentError(key, f"{key}: {value} is not {what}. Give a folder inside {' or '.join(roots)} "
                                             "that holds one (a finished run's output_dir, say).")
            elif BUILT_IN.fullmatch(value):
                _check_built_in(key, value, wanted == "config.json")
            elif not _in_hub_cache(value, wanted):
                raise ArgumentError(key, f"{key}: {value!r} reads as a hub id, and it is not in this machine's hub cache; "
                                         "the web UI never downloads a model. Download it first (`hf download "
                                         f"{value}`) or give a local folder.")


def _check_built_in(key: str, value: str, is_model: bool) -> None:
    from registries.models.demo import list_demo_models
    from registries.models.families import list_model_families

    kind, _, name = value.partition(":")
    known = list_model_families() if kind == "tiny" else list_demo_models()
    if not is_model:
        raise ArgumentError(key, f"{key}: {value!r} is a built-in model id, not an adapter folder (one holding "
                                 "adapter_config.json).")
    if name not in known:
        raise ArgumentError(key, f"{key}: {value!r} is no built-in model; {kind}: takes one of {', '.join(known)}.")


def _in_hub_cache(repo_id: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)
    except Exception:  # noqa: BLE001 (a spelling the hub library refuses is not cached either)
        return False
