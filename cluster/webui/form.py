"""The Train tab's form: form values <-> the config dict <-> YAML text (its fields: fields.py).

The form edits a plain LLaMA-Factory-style config, the same dict a YAML file holds. Keys the form
has no field for (loaded from a YAML) are kept as they are, so load -> save changes nothing the
user did not touch. Validation is the CLI's own: ``load_config`` of that dict, and its
``ConfigError`` paragraph is what the page shows next to the field it names.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import asdict
from typing import Any

import yaml

from registries.errors import UserError

from .fields import (  # noqa: F401 (the field table, read through this module by the server and tests)
    FIELD_BY_KEY, FIELDS, HUB_MODELS, LABELS, NEW_FORM_EXTRA, REQUIRED_CHOICES, RL, RL_LITERALS, RL_REGISTERED,
    RL_STAGES, SECTIONS, Field,
)


def form_spec() -> dict[str, Any]:
    """The fields with their choices filled from the registries, for the page to draw."""
    from registries.templates import list_templates
    from stages.table import STAGES

    fields = []
    for f in FIELDS:
        choices = f.choices
        if f.key == "template":
            choices = ("auto", *sorted(list_templates()))
        elif f.key == "stage":
            choices = tuple(STAGES)
        elif f.key in RL_LITERALS or f.key in RL_REGISTERED:
            choices = rl_choices(f.key)
        elif f.key == "reward_model_type":
            from stages.run_args import FinetuningArguments

            choices = literal_choices(FinetuningArguments, f.key)
        if f.kind == "select" and f.key not in REQUIRED_CHOICES:
            choices = ("", *choices)
        fields.append({**asdict(f), "choices": list(choices), "label": LABELS.get(f.key, f.key)})
    return {"sections": list(SECTIONS), "fields": fields, "extra_text": extra_text(NEW_FORM_EXTRA),
            "models": model_suggestions(), "model_list": model_list()}


def rl_choices(key: str) -> tuple[str, ...]:
    """The values an RL select offers: the names registered for it, or the Literal of its RLArguments
    field; either way the loader's own check."""
    from stages.rl.config.rl_args import RLArguments

    if key in RL_REGISTERED:
        from stages.rl.algorithms.registry import choices

        return choices(key)
    return literal_choices(RLArguments, key)


def literal_choices(cls: type, key: str) -> tuple[str, ...]:
    import typing

    hint = typing.get_type_hints(cls)[key]
    while typing.get_origin(hint) is not typing.Literal:  # Optional[Literal[...]]
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return tuple(typing.get_args(hint))


def model_suggestions() -> list[str]:
    """What the model field offers besides a hub id or a folder: the offline tiny and demo models."""
    from registries.models.demo import DEMO_PREFIX, list_demo_models
    from registries.models.families import list_model_families

    return [f"tiny:{family}" for family in list_model_families()] + [DEMO_PREFIX + m for m in list_demo_models()]


def model_list() -> list[dict[str, str]]:
    """Every model the field suggests, as {name, template (what picking it sets), note}: the tiny
    models with their family's template and the demo models with their own (the registries'), then
    HUB_MODELS."""
    from registries.models.demo import DEMO_PREFIX, get_demo_model, list_demo_models
    from registries.models.families import get_model_family, list_model_families

    out = [{"name": f"tiny:{name}", "template": get_model_family(name).template,
            "note": f"random-init {name}, offline"} for name in list_model_families()]
    out += [{"name": DEMO_PREFIX + name, "template": get_demo_model(name).template, "note": "a real small model"}
            for name in list_demo_models()]
    out += [{"name": name, "template": template, "note": "hub id (from the hub cache)"} for name, template in HUB_MODELS]
    return out


def extra_text(extra: dict[str, Any]) -> str:
    """The keys the form has no field for, as the YAML the page's "more keys" box holds."""
    if not extra:
        return ""
    return yaml.safe_dump(extra, default_flow_style=False, sort_keys=False, allow_unicode=True)


def config_from_form(values: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config dict the form describes: ``extra`` (keys the form has no field for, or whose
    field is hidden) first, then every shown field that is not blank, with numbers as numbers and
    dataset lists comma-joined."""
    config: dict[str, Any] = dict(extra or {})
    for f in FIELDS:
        if not _shown(f, values):  # another stage's or tuning type's option: only what extra holds
            continue
        value = _typed(f, values.get(f.key, f.default))
        if value is None:
            if not (f.kind == "check" and config.get(f.key) is False):  # a loaded explicit false stays
                config.pop(f.key, None)
        elif f.key == "resources_per_worker":  # the form edits the CPUs; GPUs and others stay
            kept = config.get(f.key)
            config[f.key] = {**(kept if isinstance(kept, dict) else {}), "CPU": value}
        else:
            config[f.key] = value
    return config


def form_from_config(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(form values, the keys the form has no field for) of a loaded config. A field the loaded
    values hide (lora_rank of a full fine-tune) keeps its key in extra, so saving writes it back."""
    values, extra = {}, {}
    for key, value in config.items():
        f = FIELD_BY_KEY.get(key)
        if f is None:
            extra[key] = value
        elif key == "resources_per_worker" and isinstance(value, dict):
            values[key] = value.get("CPU", "")
            if set(value) - {"CPU"}:  # GPUs and custom resources live on in extra, merged back on save
                extra[key] = value
        elif f.kind == "datasets":
            values[key] = value if isinstance(value, list) else [v.strip() for v in str(value).split(",") if v.strip()]
        elif f.kind == "list":  # the text box's comma-separated entries; _typed makes the list again
            values[key] = ", ".join(map(str, value)) if isinstance(value, list) else value
        else:
            values[key] = value
    for f in FIELDS:  # a field the YAML leaves out is blank, not the form's default
        values.setdefault(f.key, False if f.kind == "check" else "")
    for f in FIELDS:
        if f.key in config and (not _shown(f, values) or (f.kind == "check" and config[f.key] is False)):
            extra[f.key] = config[f.key]
    return values, extra


def _shown(f: Field, values: dict[str, Any]) -> bool:
    if not f.when:
        return True
    controller, *allowed = f.when
    value = values.get(controller)
    return (FIELD_BY_KEY[controller].default if value in (None, "") else value) in allowed


def _typed(f: Field, value: Any) -> Any:
    """None for blank; numbers parsed (a text the CLI would refuse stays text, so it gets the
    CLI's own error); a dataset list joined the way LLaMA-Factory writes it."""
    if f.kind == "check":
        return True if value in (True, "true", "on") else None
    if f.kind == "datasets":
        names = value if isinstance(value, list) else str(value).split(",")
        names = [n.strip() for n in names if str(n).strip()]
        return ",".join(names) or None
    if f.kind == "list":  # "a, b" (or a JSON list) -> [a, b]; an entry the CLI would refuse stays text
        entries = value if isinstance(value, list) else str(value if value is not None else "").split(",")
        entries = [e.strip() if isinstance(e, str) else e for e in entries]
        entries = [e for e in entries if e not in ("", None)]
        if f.item == "number":
            entries = [_number(e) if isinstance(e, str) else e for e in entries]
        return entries or None
    if isinstance(value, str):
        value = value.strip()
        if value == "":
            return None
        if f.kind == "number":
            return _number(value)
    return value


def _number(text: str) -> Any:
    """An int or float of ``text``, or ``text`` itself when it is neither, or not finite ("nan",
    "1e999": no config holds those, and JSON cannot carry them back): the CLI names the mistake."""
    for parse in (int, float):
        try:
            number = parse(text)
        except ValueError:
            continue
        return number if math.isfinite(number) else text
    return text


def to_yaml(config: dict[str, Any]) -> str:
    """YAML in LLaMA-Factory's example layout: one ``### section`` block per group of keys."""
    lines: list[str] = []
    placed = set()
    for section in SECTIONS:
        keys = [f.key for f in FIELDS if f.section == section and f.key in config]
        if section == "method":
            keys = [k for k in ("do_train",) if k in config] + keys
        if section == "output":
            keys += [k for k in ("plot_loss",) if k in config]
        if keys:
            lines.append(f"### {section}")
            lines += [_dump(k, config[k]) for k in keys]
            lines.append("")
            placed.update(keys)
    rest = [k for k in config if k not in placed]
    if rest:
        lines.append("### more")
        lines += [_dump(k, config[k]) for k in rest]
    return "\n".join(lines).rstrip() + "\n"


def write_yaml(path: str, config: dict[str, Any]) -> None:
    """``to_yaml`` into ``path``, whole or not at all (a file being replaced is never left half-written)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial"
    if os.path.islink(partial):  # never write through a link left in the way
        os.remove(partial)
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644),
              "w", encoding="utf-8") as f:
        f.write(to_yaml(config))
    os.replace(partial, path)


def _dump(key: str, value: Any) -> str:
    return yaml.safe_dump({key: value}, default_flow_style=False, sort_keys=False, allow_unicode=True).rstrip()


def parse_yaml(text: str) -> dict[str, Any]:
    """A YAML file's config dict, read by the CLI's own reader (duplicate keys refused, and so on).
    The page's YAML holds plain data only: no anchors or aliases (one alias can stand for millions of
    values) and nothing JSON cannot carry back to the page."""
    from ..config_yaml import load_yaml as _load_yaml

    try:
        if any(isinstance(t, (yaml.AnchorToken, yaml.AliasToken)) for t in yaml.scan(text)):
            raise UserError("the YAML uses anchors or aliases (&name, *name); the web UI takes plain YAML: "
                            "write the values out.")
        config = _load_yaml(text)
        _check_plain(config, "")
    except yaml.YAMLError as exc:
        raise UserError(f"the YAML does not parse: {exc}") from None
    except RecursionError:
        raise UserError("the YAML is nested too deeply.") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UserError(f"a config is a mapping of keys to values; this YAML holds a {type(config).__name__}.")
    return config


def _check_plain(value: Any, where: str) -> None:
    """Refuse what JSON cannot carry: dates, binary, sets, non-string keys, NaN and infinities."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise UserError(f"the YAML key {key!r} {where and f'under {where} '}is not a name; quote it.")
            _check_plain(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where or 'the YAML'}: {value} is not a number the web UI takes; give a finite one.")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise UserError(f"{where or 'the YAML'} holds a {type(value).__name__} ({value!r:.60}); the web UI takes "
                        f"strings, numbers, booleans, lists and mappings: quote it.")


def command_line(config_path: str, job_address: str | None = None) -> str:
    """The command the Start button runs (as a Ray job) and a user could run instead."""
    command = f"rayfactory train {shlex.quote(config_path)}"
    if job_address:
        command = f"rayfactory submit {shlex.quote(config_path)} --address {shlex.quote(job_address)}"
    return command


def validate(config: dict[str, Any]) -> dict[str, str] | None:
    """None when the CLI would accept ``config``, else {"key": the field it names, "message": its paragraph}."""
    from fabric.data.prepare import check_data
    from registries.datasets.info import get_dataset_attrs

    from ..config import load_config

    for f in FIELDS:  # "nan" or "1e999" in a number field: no config holds those (parse_yaml refuses them)
        value = config.get(f.key) if f.kind == "number" or f.item == "number" else None
        bad = [e for e in (value if isinstance(value, list) else [value]) if isinstance(e, str) and _not_finite(e)]
        if bad:
            return {"key": f.key, "message": f"{f.key}: {bad[0]!r} is not a finite number; give a finite one"
                                             f"{' (comma-separated)' if f.kind == 'list' else ''}."}
    try:
        cfg = load_config(dict(config), purpose="check")  # a config being looked at runs none of its modules
    except UserError as exc:  # load_config's refusals name their key (cluster/config_rules.py)
        message = str(exc)
        return {"key": _field_of(getattr(exc, "key", None), config) or _named_key(message, config), "message": message}
    except (TypeError, ValueError) as exc:  # a dataclass's own check, worded for the developer
        return {"key": _named_key(str(exc), config), "message": str(exc)}
    for key in ("dataset", "eval_dataset"):  # an unknown name fails here, not minutes later in the job
        try:
            get_dataset_attrs(getattr(cfg.data, key), cfg.data.dataset_dir)
        except UserError as exc:
            return {"key": key, "message": str(exc)}  # the CLI's paragraph; the page shows it at the field
    try:  # the driver's own data checks: a dataset is set, fits the stage, its files exist
        check_data(cfg.data, cfg.job_spec().stage)
    except UserError as exc:
        return {"key": "dataset", "message": str(exc)}
    return None


def _not_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _field_of(key: str | None, config: dict[str, Any]) -> str | None:
    """Where the page shows a refusal about ``key``: its field, or the "more keys" box for a key of
    the config without a field."""
    if key in FIELD_BY_KEY:
        return key
    return "extra" if key in config else None


def _named_key(message: str, config: dict[str, Any]) -> str:
    """For an error that names no key (a dataclass's own check, a group's ValueError): the first
    key of the config its text quotes (its field, or the "more keys" box), else the first field it names."""
    leading = re.match(r"(?:invalid )?([a-z][a-z_0-9]*) in ", message)  # the CLI's "invalid beta in <file>: ..."
    if leading and leading.group(1) in config:
        return leading.group(1) if leading.group(1) in FIELD_BY_KEY else "extra"
    quoted = re.findall(r"'([a-z_0-9]+)'", message)
    for candidate in quoted:
        if candidate in config:
            return candidate if candidate in FIELD_BY_KEY else "extra"
    words = re.findall(r"\b([a-z][a-z_0-9]+)\b", message)
    for candidate in quoted + words:
        if candidate in FIELD_BY_KEY:
            return candidate
    return ""
