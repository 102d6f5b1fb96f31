"""The documentation site (mkdocs.yml over docs/): it builds with --strict, and --strict really
fails on a broken link or anchor, so a renamed page or heading cannot leave dead links behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strict(tmp_path):
    done = build(REPO_ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "Getting started" in index and "config-reference/" in index
    assert (tmp_path / "site" / "config-reference" / "index.html").is_file()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    shutil.copytree(REPO_ROOT / "docs", tmp_path / "docs")
    shutil.copy(REPO_ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    index = tmp_path / "docs" / "index.md"
    original = index.read_text(encoding="utf-8")
    for broken in ("[gone](no-such-page.md)", "[gone](rl.md#no-such-heading)"):
        index.write_text(original + f"\n{broken}\n", encoding="utf-8")
        done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert done.returncode != 0, broken
        assert broken.split("(")[1].rstrip(")").split("#")[-1] in done.stdout + done.stderr, done.stderr
