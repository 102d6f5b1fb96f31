"""The house's one rule of direction: cluster -> fabric -> stages -> registries.

A package imports only from its own floor and the floors below it, wherever the import stands
(module top or inside a function: a lazy import still ties the floors together), Ray is imported
only by cluster/ and fabric/ (stages/ and registries/ run without a cluster), and no modules
import each other in a circle (one closed by an import inside a function included).

Inside stages/ the same rule holds for its rooms, top to bottom:

    recipes -> rl/controller -> rl/workers | rl/agents -> rl/config -> rl/algorithms -> training

A module imports only from its own room and the rooms below it (absolute or relative, at module
top or inside a function). rl/workers and rl/agents share a level: neither imports the other.
training is the bottom of stages/: it imports nothing of stages/ outside itself. The parts of
stages/ outside the rooms (job, loading, table, engines, inference, ...) are not ranked here.
"""

from __future__ import annotations

import ast
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ("registries", "stages", "fabric", "cluster")  # bottom to top
WITHOUT_RAY = ("registries", "stages")


def _python_files(package: str):
    for root, _, names in os.walk(os.path.join(REPO_ROOT, package)):
        for name in names:
            if name.endswith(".py"):
                yield os.path.join(root, name)


def _imported_packages(path: str) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a file (relative ones stay on its floor)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def _violations(package: str) -> list[str]:
    floor = FLOORS.index(package)
    out = []
    for path in _python_files(package):
        for name, line in sorted(_imported_packages(path)):
            where = f"{os.path.relpath(path, REPO_ROOT)}:{line}"
            if name in FLOORS and FLOORS.index(name) > floor:
                out.append(f"{where} imports {name} (a floor above {package})")
            if name == "ray" and package in WITHOUT_RAY:
                out.append(f"{where} imports ray ({package} runs without a cluster)")
    return out


@pytest.mark.parametrize("package", FLOORS)
def test_no_import_runs_up_a_floor_and_ray_stays_in_cluster_and_fabric(package):
    assert _violations(package) == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule catches what it claims to: a lazy import of fabric inside a function in stages/."""
    stages = tmp_path / "stages"
    stages.mkdir()
    (stages / "recipe.py").write_text("def run():\n    from fabric.worker import train\n    import ray.train\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", str(tmp_path))
    assert _violations("stages") == ["stages/recipe.py:2 imports fabric (a floor above stages)",
                                     "stages/recipe.py:3 imports ray (stages runs without a cluster)"]


# The rooms of stages/, bottom to top; rooms on one level may not import each other.
ROOMS = (
    ("stages.training",),
    ("stages.rl.algorithms",),
    ("stages.rl.config",),
    ("stages.rl.workers", "stages.rl.agents"),
    ("stages.rl.controller",),
    ("stages.recipes",),
)


def _room_of(module: str):
    """(level, room) of a dotted module name, or None outside the rooms."""
    for level, rooms in enumerate(ROOMS):
        for room in rooms:
            if module == room or module.startswith(room + "."):
                return level, room
    return None


def _imported_modules(path: str, module: str) -> set[tuple[str, int]]:
    """(dotted target, line) of every import in a file, relative ones resolved against ``module``;
    ``from a import b`` is a.b where a is no room itself (``from stages.rl import workers``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(alias.name, node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = (package[: len(package) - node.level + 1] if node.level else []) + (node.module or "").split(".")
            base = ".".join(p for p in parts if p)
            if _room_of(base) is None and base in ("stages", "stages.rl"):
                found |= {(f"{base}.{alias.name}", node.lineno) for alias in node.names}
            else:
                found.add((base, node.lineno))
    return found


def _room_violations(root: str) -> list[str]:
    out = []
    for path in _python_files_under(root, "stages"):
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        here = _room_of(module)
        if here is None:
            continue
        for target, line in sorted(_imported_modules(path, module)):
            there = _room_of(target)
            where = f"{os.path.relpath(path, root)}:{line}"
            if there is not None and (there[0] > here[0] or (there[0] == here[0] and there[1] != here[1])):
                out.append(f"{where} imports {target} (room {there[1]} is not below room {here[1]})")
            elif here[0] == 0 and there is None and target.startswith("stages."):
                out.append(f"{where} imports {target} ({here[1]} is the bottom of stages/)")
    return sorted(out)


def test_no_import_runs_up_a_room_of_stages():
    assert _room_violations(REPO_ROOT) == []


def test_the_room_check_sees_an_upward_a_sideways_and_a_relative_import(tmp_path):
    """A worker importing the controller inside a function, an agent importing a worker relatively
    (a room beside it), config naming a room above it from stages.rl, and training importing
    stages/loading.py are each caught; config importing algorithms (below it) is not."""
    for room in ("training", "rl/workers", "rl/agents", "rl/controller"):
        (tmp_path / "stages" / room).mkdir(parents=True)
    (tmp_path / "stages" / "rl" / "workers" / "policy.py").write_text(
        "from stages.rl.config.types import RolloutSample\n\ndef step():\n    from stages.rl.controller import loop\n")
    (tmp_path / "stages" / "rl" / "agents" / "tools.py").write_text("from ..workers.policy import step\n")
    (tmp_path / "stages" / "training" / "value_head.py").write_text("def load():\n    from stages.loading import load_model\n")
    (tmp_path / "stages" / "rl" / "config").mkdir()
    (tmp_path / "stages" / "rl" / "config" / "checks.py").write_text("from stages.rl import agents, algorithms\n")
    assert _room_violations(str(tmp_path)) == [
        "stages/rl/agents/tools.py:1 imports stages.rl.workers.policy (room stages.rl.workers is not below room stages.rl.agents)",
        "stages/rl/config/checks.py:1 imports stages.rl.agents (room stages.rl.agents is not below room stages.rl.config)",
        "stages/rl/workers/policy.py:4 imports stages.rl.controller (room stages.rl.controller is not below room stages.rl.workers)",
        "stages/training/value_head.py:2 imports stages.loading (stages.training is the bottom of stages/)",
    ]


def _module_graph(root: str) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (any import, relative ones resolved; a module's
    own parent packages are not counted: importing a.b.c runs a and a.b first anyway)."""
    paths = {}
    for package in FLOORS:
        for path in _python_files_under(root, package):
            name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            paths[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in paths.items():
        here = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        targets = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join((here[: len(here) - node.level + 1] if node.level else []) + [node.module or ""]).strip(".")
                targets += [base] + [f"{base}.{alias.name}" for alias in node.names]
        graph[name] = set()
        for target in targets:
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def _python_files_under(root: str, package: str):
    for folder, _, names in os.walk(os.path.join(root, package)):
        yield from (os.path.join(folder, n) for n in names if n.endswith(".py"))


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_modules_import_each_other_in_a_circle():
    assert _circles(_module_graph(REPO_ROOT)) == []


def test_the_circle_check_sees_a_circle_closed_inside_a_function(tmp_path):
    (tmp_path / "fabric" / "data").mkdir(parents=True)
    (tmp_path / "fabric" / "data" / "pipeline.py").write_text("from .tokenizing import run\n")
    (tmp_path / "fabric" / "data" / "tokenizing.py").write_text("def run():\n    from . import pipeline\n")
    (tmp_path / "fabric" / "data" / "alone.py").write_text("from fabric.data import pipeline\n")
    assert _circles(_module_graph(str(tmp_path))) == [["fabric.data.pipeline", "fabric.data.tokenizing"]]
