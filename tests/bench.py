"""A benchmarks/ script as a module, for the tests that run a benchmark's own code (a learning
run's arms, the LLaMA-Factory venv it builds). benchmarks/ goes on sys.path first: its scripts
import their shared ``harness`` module by name, as they do when run as scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
