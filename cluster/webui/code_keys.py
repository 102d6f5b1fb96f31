"""Keys of a config that make a run execute code of the config's choosing, and the web UI's rule for them.

A config from the page is a request from whoever reaches the UI's port. Some keys name Python to
import and call (``reward_funcs`` / ``tools`` / ``environment`` as ``module.path:attr``), change how
Ray starts the job's processes (``ray_init_kwargs``: a runtime_env's ``py_executable`` is a shell
command line), or let a model folder bring its own code (``trust_remote_code``). From the UI these
are refused unless it was started with ``--allow-code``, and even then a module must be a file inside
the UI's folder: found on disk here, never imported (validating a config must not run it).
Built-in names (``exact_match``, ``calculator``, ``python``, ``tools``) always work.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from registries.errors import ArgumentError

from .paths import confine

SPEC_KEYS = ("reward_funcs", "tools", "environment")  # built-in names or "module.path:attr"
# runtime_env fields that run a command or install packages (whose setup code runs): never from the UI.
RUNTIME_ENV_COMMANDS = ("py_executable", "pip", "uv", "conda", "container", "image_uri", "worker_process_setup_hook")
# ray.init keyword arguments and runtime_env fields that name local folders: confined like any path.
RAY_PATH_KEYS = ("_temp_dir", "storage")
RUNTIME_ENV_PATHS = ("working_dir", "py_modules", "excludes")
OPT_IN = ("start the web UI with --allow-code (it then runs modules inside its own folder only), or run the "
          "config from the command line: rayfactory train <config>")


def check_code_keys(config: dict[str, Any], roots: Sequence[str], allow_code: bool) -> None:
    """An ArgumentError naming the key when ``config`` would run code the UI must not run; with
    ``allow_code``, user modules must be files inside ``roots[0]`` and ray_init_kwargs' paths inside
    ``roots``."""
    for key in SPEC_KEYS:
        for spec in _specs(config.get(key)):
            if ":" not in spec:
                continue  # a built-in name (or a typo, which the config check reports)
            if not allow_code:
                raise ArgumentError(key, f"{key} {spec!r} names Python code to import and run; this web UI runs only "
                                         f"built-in {key} ({_builtins(key)}). To use your own, {OPT_IN}.")
            _check_module(key, spec, roots[0])
    kwargs = config.get("ray_init_kwargs")
    if kwargs not in (None, "", {}):
        if not allow_code:
            raise ArgumentError("ray_init_kwargs", "ray_init_kwargs changes how Ray starts the job's processes (a "
                                                   f"runtime_env can run any command); this web UI refuses it. {_cap(OPT_IN)}.")
        _check_ray_kwargs(kwargs, roots)
    if config.get("trust_remote_code") not in (None, False, "false", "False"):
        if not allow_code:
            raise ArgumentError("trust_remote_code", "trust_remote_code runs Python files that come with the model; "
                                                     f"this web UI refuses it. {_cap(OPT_IN)}.")


def _specs(value: Any) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return [v.strip() for v in value if isinstance(v, str)]
    return []


def _builtins(key: str) -> str:
    from stages.rl.agents.environments import ENVIRONMENTS
    from stages.rl.controller.rewards import REWARDS
    from stages.rl.agents.tools import TOOLS

    return ", ".join(sorted({"reward_funcs": REWARDS, "tools": TOOLS, "environment": ENVIRONMENTS}[key]))


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _check_module(key: str, spec: str, folder: str) -> None:
    """``module.path`` of ``spec`` is a file inside ``folder`` that the job will import from there: not a
    module of the standard library or one already loaded, which would be found first."""
    from stages.rl.config.specs import module_file

    module_name = spec.partition(":")[0]
    top = module_name.split(".")[0]
    where = module_file(module_name, [folder]) if top.isidentifier() else None
    shadowed = top in sys.stdlib_module_names or top in sys.builtin_module_names or (
        top in sys.modules and not _inside(getattr(sys.modules[top], "__file__", None) or "", folder))
    if where is None or shadowed or not _inside(where, folder):
        raise ArgumentError(key, f"{key} {spec!r}: module {module_name!r} is not a file inside this web UI's folder "
                                 f"({folder}); with --allow-code the UI runs only modules found there (a module of "
                                 "Python or an installed package is never one). Put the module in that folder.")


def _inside(path: str, folder: str) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(folder)
    return bool(path) and real.startswith(top.rstrip(os.sep) + os.sep)


def _check_ray_kwargs(kwargs: Any, roots: Sequence[str]) -> None:
    key = "ray_init_kwargs"
    if not isinstance(kwargs, dict):
        return  # its type error is the config check's
    env = kwargs.get("runtime_env") or {}
    if isinstance(env, dict):
        for name in RUNTIME_ENV_COMMANDS:
            if name in env:
                raise ArgumentError(key, f"ray_init_kwargs.runtime_env.{name} runs a command or installs packages "
                                         "when Ray starts a worker; the web UI never passes it on, even with "
                                         "--allow-code. Install what the run needs beforehand, or run the config "
                                         "from the command line.")
        _confine_all(env, RUNTIME_ENV_PATHS, roots, f"{key}.runtime_env", lambda v: "://" not in v)
    _confine_all(kwargs, RAY_PATH_KEYS, roots, key, lambda v: True)


def _confine_all(values: dict[str, Any], names: Sequence[str], roots: Sequence[str], where: str,
                 is_path: Callable[[str], bool]) -> None:
    for name in names:
        value = values.get(name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and is_path(item):
                confine(item, roots, f"{where}.{name}")
            elif item is not None and not isinstance(item, str):
                raise ArgumentError("ray_init_kwargs", f"{where}.{name} must be a path (or a list of paths) "
                                                       "inside the web UI's folders.")
