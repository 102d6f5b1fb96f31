"""Write docs/config-reference.md from the typed config: every key a YAML may carry, by group.

Each row is read from the code, not kept by hand: the key and its type from the group's dataclass
(cluster/config.py's GROUPS), the default from the field, and the text from the comments written
beside the field in its source file (the block right above it, then the one at the end of its
line). transformers' own TrainingArguments keys are listed by name, from the installed version;
LLaMA-Factory's keys that load but mean nothing here, or that are refused when on, come from
cluster/lf_compat.py.

    .venv/bin/python scripts/config_reference.py           # rewrite the page
    .venv/bin/python scripts/config_reference.py --check   # exit 1 if the page is out of date

tests/cluster/test_config_reference.py runs the check in CI, so a key added without its page
fails the suite.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import tokenize
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PAGE = REPO_ROOT / "docs" / "config-reference.md"
# The groups in the order a config is usually written, and what each one is.
GROUP_TITLES = {
    "model": "Which model, adapter and precision to load",
    "data": "Datasets, the chat template, tokenization and batching of rows",
    "finetuning": "The stage (pt, sft, rm, dpo, kto, grpo, ppo), the tuning type and their losses",
    "rl": "Rollouts, rewards, roles and their placement for grpo and ppo",
    "ray": "The Ray cluster, workers and their resources",
    "generating": "Sampling for chat, predict, serve and the RL rollouts",
    "inference": "The inference engine of chat, predict and serve",
    "export": "rayfactory export: merging an adapter, quantizing, GGUF",
    "serve": "rayfactory serve: the Ray Serve app, its guards and limits",
    "evaluation": "rayfactory eval: lm-evaluation-harness tasks, shots and where results go",
}


def field_notes(cls: type) -> dict[str, str]:
    """Field name -> the comments written beside it, for ``cls`` and the classes it inherits."""
    notes: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not object:
            notes.update(_class_notes(klass))
    return notes


def _class_notes(klass: type) -> dict[str, str]:
    source = Path(inspect.getsourcefile(klass)).read_text(encoding="utf-8")
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
    notes = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1  # 1-based line numbers: the line right above the field
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        inline = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        notes[stmt.target.id] = " ".join(part for part in [*above, *inline] if part)
    return notes


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def group_table(name: str, cls: type) -> list[str]:
    notes = field_notes(cls)
    out = [f"## {name}", "", f"{GROUP_TITLES.get(name, '')} (`{cls.__module__}.{cls.__name__}`).", "",
           "| key | type | default | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        # "str | None" written "str or None": an escaped pipe inside a code span shows its backslash on the site.
        kind = _cell(str(f.type).replace(" | ", " or "))
        out.append(f"| `{f.name}` | `{kind}` | `{_cell(default_text(f))}` | {_cell(notes.get(f.name, ''))} |")
    return out + [""]


def render() -> str:
    from cluster.config import GROUPS, key_owners
    from cluster.lf_compat import IGNORED_KEYS, MULTIMODAL_KEYS, UNSUPPORTED_KEYS

    owners = key_owners()
    trainer_keys = sorted(k for k, group in owners.items() if group == "training")
    out = [
        "# Config reference",
        "",
        "<!-- Written by scripts/config_reference.py from the typed config; do not edit by hand. -->",
        "",
        "A config is one flat YAML mapping with LLaMA-Factory's key names (`rayfactory train cfg.yaml`,",
        "or `key=value` on the command line after it). Each key belongs to one group below; a key no",
        "group owns is refused with the closest spelling. The text of each row is the comment beside",
        "the field in the code, so it says what the code does.",
        "",
        "Groups: " + ", ".join(f"[{name}](#{name})" for name in GROUPS) + ", [training](#training), "
        "[LLaMA-Factory keys](#llama-factory-keys).",
        "",
    ]
    for name, cls in GROUPS.items():
        out += group_table(name, cls)
    out += [
        "## training",
        "",
        "Every field of the installed transformers' `Seq2SeqTrainingArguments` "
        f"({len(trainer_keys)} keys) is a key, passed to the Trainer as it is: `learning_rate`,",
        "`num_train_epochs`, `per_device_train_batch_size`, `output_dir`, `save_steps`, `seed` and the rest. Their",
        "meaning and defaults are transformers'; the stage checks the combinations it cannot run.",
        "",
        ", ".join(f"`{key}`" for key in trainer_keys),
        "",
        "## LLaMA-Factory keys",
        "",
        "Keys of LLaMA-Factory's YAML files that load unchanged but mean nothing here: accepted, dropped,",
        "and named in a note when the run starts.",
        "",
        "| key | why it is dropped |",
        "|---|---|",
        *[f"| `{key}` | {_cell(why)} |" for key, why in sorted(IGNORED_KEYS.items())],
        "",
        "LLaMA-Factory features not built here: accepted only when off (`false`, `null`, 0), refused",
        "in one paragraph when on, so a run never trains something other than what its YAML says.",
        "",
        ", ".join(f"`{key}`" for key in sorted(UNSUPPORTED_KEYS)),
        "",
        "Video and audio keys of LLaMA-Factory's multimodal YAML files: accepted and ignored with a",
        "note (RayFactory reads images only; a dataset with a video or audio column is refused).",
        "",
        ", ".join(f"`{key}`" for key in sorted(MULTIMODAL_KEYS)),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the code")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE.relative_to(REPO_ROOT)} is out of date: run .venv/bin/python scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
