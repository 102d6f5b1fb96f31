"""LLaMA-Factory 0.9.5 as a reference for parity tests: a script run in its own venv, JSON back.

The venv is the one benchmarks/vs_llamafactory.py uses (``~/.cache/rayfactory/lf-0.9.5``): built on
first use from PyPI (CPU torch first, then llamafactory==0.9.5), as the template tests fetch their
tokenizers once, and reused after. Where it cannot be built the test skips, except in CI, where it
fails: a parity check the suite claims is never silently left out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

from tests.ci import skip_or_fail_in_ci

REPO_ROOT = Path(__file__).resolve().parent.parent
LF_VENV = Path.home() / ".cache" / "rayfactory" / "lf-0.9.5"
LF_PYTHON = LF_VENV / "bin" / "python"


def llamafactory_python() -> Path:
    """The python of the LLaMA-Factory venv, building it the first time (minutes)."""
    if not LF_PYTHON.exists():
        spec = importlib.util.spec_from_file_location("vs_llamafactory", REPO_ROOT / "benchmarks" / "vs_llamafactory.py")
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.ensure_lf_venv(str(LF_VENV))
        except Exception as exc:  # no network, no disk: a skip here, a failure in CI
            skip_or_fail_in_ci(f"the LLaMA-Factory 0.9.5 venv at {LF_VENV} is missing and could not be built: {exc}")
    return LF_PYTHON


def run_in_llamafactory(script: str, payload: dict, timeout: float = 300) -> dict:
    """Run ``script`` (reading its JSON payload from argv[1]) in the LLaMA-Factory venv; the JSON
    object it prints last."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DISABLE_VERSION_CHECK="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([str(llamafactory_python()), "-c", script, json.dumps(payload)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
