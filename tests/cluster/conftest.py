"""Helpers for the config tests: each test runs in its own folder, writes YAML there, reads errors."""

from __future__ import annotations

import textwrap

import pytest

from cluster.config import ConfigError, load_config

BASE = {"model_name_or_path": "tiny-model", "dataset": "demo", "output_dir": "out"}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in configs resolve inside the test's folder


def write(text: str, name: str = "cfg.yaml") -> str:
    with open(name, "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(text))
    return name


def error_of(config, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, overrides)
    return str(info.value)
