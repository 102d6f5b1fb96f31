"""Finding what a config names: a built-in by name, or ``"module.path:attribute"`` from a user module.

Reward functions, tools and environments are all named this way; one resolver gives them the same
rules and the same error messages (each says which kind of thing and which spec failed).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import sys
from typing import Any, Iterator, Mapping, Optional


def resolve_spec(spec: str, builtins: Mapping[str, Any], kind: str, error: type[Exception], shape: str,
                 run_module: bool = True) -> Optional[Any]:
    """What ``spec`` names: ``builtins[spec]``, or the attribute of a user module, which must be
    callable (a function or a class). ``kind`` ("reward function", "tool", "environment") and
    ``shape`` (what it must look like, a sentence) go into the ``error`` raised for a bad spec.
    ``run_module`` False only finds a user module's file without running any code, not even its
    parent packages' ``__init__`` (its own imports may exist only where the job runs, and the web UI
    checks configs it must not execute): None when it is there."""
    label = kind[0].upper() + kind[1:]
    if ":" not in spec:
        if spec in builtins:
            return builtins[spec]
        raise error(
            f"Unknown {kind} {spec!r}. Built-ins: {sorted(builtins)}; for your own, write "
            f"'module.path:{'Class' if kind == 'environment' else 'function'}' with the module importable from the "
            "working directory.")
    module_name, _, attr = spec.partition(":")
    try:
        if not run_module:
            if module_file(module_name) is None:
                raise ModuleNotFoundError(f"No module named {module_name!r}", name=module_name)
            return None
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise error(  # the module exists; something it imports does not
                f"{label} {spec!r}: importing module {module_name!r} failed with ModuleNotFoundError: "
                f"{exc}. Install that package on every node or remove the import.") from exc
        raise error(
            f"{label} {spec!r}: module {module_name!r} was not found ({exc}). Put it in the working "
            "directory or the repo root (it must be importable on every worker) and check the spelling.") from exc
    except Exception as exc:
        raise error(
            f"{label} {spec!r}: importing module {module_name!r} failed with {type(exc).__name__}: {exc}. "
            "Fix the error in that module.") from exc
    if not attr or not hasattr(module, attr):
        raise error(
            f"{label} {spec!r}: module {module_name!r} has no attribute {attr!r}. Write "
            f"'module.path:name' with the name of something defined in that module.")
    found = getattr(module, attr)
    if not callable(found):
        raise error(
            f"{label} {spec!r}: {attr!r} in {module_name!r} is a {type(found).__name__}, not callable. {shape}")
    return found


def module_file(module_name: str, path: Optional[list[str]] = None) -> Optional[str]:
    """Where ``module_name`` ("a.b.c") would be imported from, found on disk along ``path`` (default
    sys.path), running nothing: ``importlib.util.find_spec("a.b")`` imports ``a`` to find ``b``.
    "built-in" for a module compiled into the interpreter, "loaded" for one already imported
    (found where the interpreter found it); None when there is no such module."""
    if not module_name or not all(part.isidentifier() for part in module_name.split(".")):
        return None
    if path is None:
        if module_name in sys.modules:
            return "loaded"
        if module_name in sys.builtin_module_names:
            return "built-in"
    parts = module_name.split(".")
    spec = None
    search = path
    for part in parts:
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
        if part != parts[-1] and not search:
            return None  # a module, not a package: it has no submodules
    return spec.origin or (search[0] if search else None)  # a namespace package has no origin


@contextlib.contextmanager
def importable_from(directory: str) -> Iterator[None]:
    """``directory`` on sys.path for the imports inside the block only. "my_rewards:score" names a
    module in the directory the run starts from, as `python -m` would find it (the rayfactory
    script's own sys.path lacks that directory); the process's path is left as it was."""
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        yield
    finally:
        if added and directory in sys.path:
            sys.path.remove(directory)
