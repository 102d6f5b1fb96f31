"""docs/config-reference.md is written from the typed config (scripts/config_reference.py): the
page in the repo is the one the code makes now, and each row carries the comments beside its field."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("config_reference", REPO_ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checked_in_page_is_the_one_the_code_writes(capsys):
    status = _script().main(["--check"])
    assert status == 0, capsys.readouterr().err  # a key added or its comment changed: run the script


@dataclasses.dataclass
class Sample:
    plain: int = 3
    # Above the field,
    # on two lines.
    commented: Literal["a", "b"] = "a"  # and at its end
    listed: list[str] = dataclasses.field(default_factory=lambda: ["x"])
    needed: str | None = None


@dataclasses.dataclass
class Inherited(Sample):
    added: bool = True  # a field of the subclass


def test_rows_carry_type_default_and_both_comments():
    rows = _script().group_table("sample", Inherited)
    by_key = {row.split("|")[1].strip(): row for row in rows if row.startswith("| `")}
    assert list(by_key) == ["`plain`", "`commented`", "`listed`", "`needed`", "`added`"]
    assert by_key["`commented`"] == ("| `commented` | `Literal['a', 'b']` | `a` | "
                                     "Above the field, on two lines. and at its end |")
    assert by_key["`plain`"] == "| `plain` | `int` | `3` |  |"
    assert by_key["`listed`"].startswith("| `listed` | `list[str]` | `[x]` |")
    assert by_key["`needed`"].startswith("| `needed` | `str or None` | `null` |")  # no pipe inside the table's cells
    assert by_key["`added`"].endswith("| a field of the subclass |")


def test_every_key_a_config_takes_is_on_the_page():
    from cluster.config import key_owners

    page = (REPO_ROOT / "docs" / "config-reference.md").read_text(encoding="utf-8")
    missing = [key for key in key_owners() if f"`{key}`" not in page]
    assert not missing, missing
