"""The house's one rule of direction: cluster -> fabric -> stages -> registries.

A package imports only from its own floor and the floors below it, wherever the import stands
(module top or inside a function: a lazy import still ties the floors together), and Ray is
imported only by cluster/ and fabric/: stages/ and registries/ run without a cluster.
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
