"""dataset_info.json: name -> where the rows are and how their columns map to a conversation.

Entries use LLaMA-Factory's keys, so its dataset_info.json files work as they are. Two of its
rules are kept because they change what the data means:

* ``columns``: when an entry has a ``columns`` object, the columns it does not name are unused
  (LLaMA-Factory sets them to None). Without ``columns`` the format's defaults apply. The
  conversation column of sharegpt/openai and the ``chosen``/``rejected`` columns of a ranking
  dataset are the exception: they are always needed, so they keep their defaults.
* hub and script entries (``hf_hub_url``, ``ms_hub_url``, ``script_url``) are loaded with the
  ``datasets`` library; they need the network, which tests and demos never use.

``tags`` missing from a ``tags`` object fall back to the format's defaults (LLaMA-Factory would
leave them unset, which only ever rejects rows).

Only the entries a run names are parsed, so a file may hold entries we cannot load (e.g.
video or audio ones) as long as they are not used.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import DataConfigError

INFO_FILE = "dataset_info.json"
FORMATS = ("alpaca", "sharegpt", "openai")
COLUMN_KEYS = ("prompt", "query", "response", "history", "messages", "system", "tools", "chosen", "rejected", "kto_tag")
TAG_KEYS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")
SOURCE_KEYS = ("file_name", "hf_hub_url", "ms_hub_url", "script_url")
ENTRY_KEYS = SOURCE_KEYS + ("formatting", "ranking", "subset", "split", "folder", "num_samples", "columns", "tags")
# LLaMA-Factory keys we recognise but cannot serve yet: named so the error says so, not "unknown".
UNSUPPORTED_KEYS = {"om_hub_url": "the OpenMind hub", "cloud_file_name": "s3/gcs files"}
# Media columns: ``images`` is read (a list of paths relative to dataset_dir); videos and audios
# are recognised so the error says "not yet", not "unknown".
MEDIA_COLUMNS = ("images",)
UNSUPPORTED_COLUMNS = ("videos", "audios")

_DEFAULT_COLUMNS = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output"},
    "sharegpt": {"messages": "conversations"},
    "openai": {"messages": "messages"},
}
_DEFAULT_TAGS = {
    "sharegpt": dict(
        role_tag="from", content_tag="value", user_tag="human", assistant_tag="gpt",
        observation_tag="observation", function_tag="function_call", system_tag="system",
    ),
    "openai": dict(
        role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant",
        observation_tag="tool", function_tag="function", system_tag="system",
    ),
}
_DEFAULT_TAGS["alpaca"] = _DEFAULT_TAGS["sharegpt"]  # unused by alpaca; kept for a uniform attr


@dataclass(frozen=True)
class DatasetAttr:
    name: str  # the key in dataset_info.json
    load_from: str  # file | hf_hub | ms_hub | script
    source: str  # file/folder path (joined with dataset_dir), hub repo id, or script folder
    info_path: str  # the dataset_info.json it came from, for error messages
    formatting: str = "alpaca"
    ranking: bool = False
    subset: str | None = None
    split: str = "train"
    folder: str | None = None
    num_samples: int | None = None
    columns: dict[str, str | None] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def column(self, key: str) -> str | None:
        return self.columns.get(key)

    def tag(self, key: str) -> str:
        return self.tags[key]

    @property
    def has_images(self) -> bool:
        return self.columns.get("images") is not None

    @property
    def dataset_dir(self) -> str:
        """The folder of the dataset_info.json; LLaMA-Factory resolves media paths against it."""
        return os.path.dirname(self.info_path)

    @property
    def has_kto_tag(self) -> bool:
        return self.columns.get("kto_tag") is not None

    def with_num_samples(self, num_samples: int | None) -> "DatasetAttr":
        return replace(self, num_samples=num_samples)


def info_path(dataset_dir: str) -> str:
    return os.path.join(dataset_dir, INFO_FILE)


def load_dataset_info(dataset_dir: str) -> dict[str, Any]:
    """The raw JSON of ``<dataset_dir>/dataset_info.json``."""
    path = info_path(dataset_dir)
    if not os.path.isfile(path):
        raise DataConfigError(
            f"No {INFO_FILE} in dataset_dir {dataset_dir!r} (looked for {path}). Set dataset_dir to the "
            f"folder that holds {INFO_FILE}, or create it there."
        )
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}, column {err.colno}"
        raise DataConfigError(f"{path} is not valid JSON: {err.msg} at {where}.") from None
    if not isinstance(info, dict):
        raise DataConfigError(f"{path} must hold a JSON object of dataset name -> entry, not a {type(info).__name__}.")
    return info


def get_dataset_attrs(names: list[str] | None, dataset_dir: str) -> list[DatasetAttr]:
    """Parse the entries for ``names`` (in order) from ``<dataset_dir>/dataset_info.json``."""
    if not names:
        return []
    info = load_dataset_info(dataset_dir)
    path = info_path(dataset_dir)
    attrs = []
    for name in names:
        if name not in info:
            close = difflib.get_close_matches(name, list(info), n=3, cutoff=0.5)
            hint = f" Did you mean: {', '.join(close)}?" if close else f" It defines: {', '.join(sorted(info)[:20])}."
            raise DataConfigError(f"Dataset {name!r} is not defined in {path}.{hint}")
        attrs.append(parse_entry(name, info[name], dataset_dir, path))
    return attrs



def train_and_eval_attrs(data_args) -> list[DatasetAttr]:
    """The entries of ``data_args.dataset`` and then ``data_args.eval_dataset`` (a DataArguments)."""
    return get_dataset_attrs(data_args.dataset, data_args.dataset_dir) + get_dataset_attrs(
        data_args.eval_dataset, data_args.dataset_dir
    )

def parse_entry(name: str, entry: Any, dataset_dir: str, path: str = INFO_FILE) -> DatasetAttr:
    where = f"Dataset {name!r} in {path}"
    if not isinstance(entry, dict):
        raise DataConfigError(f"{where} must be a JSON object, got {type(entry).__name__}.")
    for key, what in UNSUPPORTED_KEYS.items():
        if key in entry and not any(k in entry for k in SOURCE_KEYS):  # usable only if it is the sole source
            raise DataConfigError(
                f"{where} uses {key!r} ({what}), which RayFactory does not load yet. Use file_name or hf_hub_url."
            )
    _reject_unknown(where, "key", {k: v for k, v in entry.items() if k not in UNSUPPORTED_KEYS}, ENTRY_KEYS)

    load_from, source = _source(where, entry, dataset_dir)
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATS:
        raise DataConfigError(f"{where}: formatting is {formatting!r}; expected one of {', '.join(FORMATS)}.")
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        raise DataConfigError(f"{where}: ranking is {ranking!r}; expected true or false.")
    num_samples = entry.get("num_samples")
    if num_samples is not None and (type(num_samples) is not int or num_samples <= 0):
        raise DataConfigError(f"{where}: num_samples is {num_samples!r}; expected a positive integer.")
    for key in ("subset", "split", "folder"):
        if key in entry and entry[key] is not None and not isinstance(entry[key], str):
            raise DataConfigError(f"{where}: {key} is {entry[key]!r}; expected a string.")

    columns = _columns(where, entry, formatting)
    tags = _tags(where, entry, formatting)
    if ranking:  # the two answers are mandatory, so like the conversation column they keep a default
        for key in ("chosen", "rejected"):
            columns[key] = columns.get(key) or key
    if ranking and columns.get("kto_tag") is not None:
        raise DataConfigError(
            f"{where} has both \"ranking\": true and a kto_tag column; a dataset holds either preference "
            "pairs (ranking) or single rated answers (kto_tag), not both."
        )
    if formatting == "alpaca" and columns.get("kto_tag") is not None and columns.get("response") is None:
        raise DataConfigError(
            f"{where} has a kto_tag column but no response column, so there is no answer to label. "
            "Add \"response\": \"<column>\" to its columns."
        )
    return DatasetAttr(
        name=name, load_from=load_from, source=source, info_path=path, formatting=formatting,
        ranking=ranking, subset=entry.get("subset"), split=entry.get("split") or "train",
        folder=entry.get("folder"), num_samples=num_samples, columns=columns, tags=tags,
    )


def _source(where: str, entry: dict, dataset_dir: str) -> tuple[str, str]:
    # Same precedence as LLaMA-Factory: a hub url wins over a script, a script over a file.
    if "hf_hub_url" in entry or "ms_hub_url" in entry:
        use_ms = "ms_hub_url" in entry and ("hf_hub_url" not in entry or _env_true("USE_MODELSCOPE_HUB"))
        key = "ms_hub_url" if use_ms else "hf_hub_url"
        return key[:-4], _str_value(where, entry, key)  # "hf_hub" / "ms_hub"
    if "script_url" in entry:
        return "script", os.path.join(dataset_dir, _str_value(where, entry, "script_url"))
    if "file_name" in entry:
        return "file", os.path.join(dataset_dir, _str_value(where, entry, "file_name"))
    raise DataConfigError(
        f"{where} says nowhere to load from. Add \"file_name\" (a file or folder inside the dataset_dir) "
        "or \"hf_hub_url\"."
    )


def _str_value(where: str, entry: dict, key: str) -> str:
    value = entry[key]
    if not isinstance(value, str) or not value:
        raise DataConfigError(f"{where}: {key} is {value!r}; expected a non-empty string.")
    return value


def _columns(where: str, entry: dict, formatting: str) -> dict[str, str | None]:
    given = entry.get("columns")
    if given is None:
        return dict(_DEFAULT_COLUMNS[formatting])
    if not isinstance(given, dict):
        raise DataConfigError(f"{where}: columns must be an object of role -> column name.")
    for key in UNSUPPORTED_COLUMNS:
        if given.get(key):
            raise DataConfigError(
                f"{where} has a {key!r} column; only image columns (\"images\") are supported yet, not {key}."
            )
    _reject_unknown(
        where, "column key", {k: v for k, v in given.items() if k not in UNSUPPORTED_COLUMNS}, COLUMN_KEYS + MEDIA_COLUMNS
    )
    for key, value in given.items():
        if value is not None and (not isinstance(value, str) or not value):
            raise DataConfigError(f"{where}: columns.{key} is {value!r}; expected a column name (string).")
    columns = {k: given.get(k) for k in COLUMN_KEYS}
    # Media keys appear only when named, so text datasets keep exactly the columns they had.
    columns.update({k: given[k] for k in MEDIA_COLUMNS if given.get(k)})
    if formatting != "alpaca" and columns["messages"] is None:
        columns["messages"] = _DEFAULT_COLUMNS[formatting]["messages"]
    return columns


def _tags(where: str, entry: dict, formatting: str) -> dict[str, str]:
    given = entry.get("tags") or {}
    if not isinstance(given, dict):
        raise DataConfigError(f"{where}: tags must be an object such as {{\"role_tag\": \"from\"}}.")
    _reject_unknown(where, "tag", given, TAG_KEYS)
    for key, value in given.items():
        if not isinstance(value, str) or not value:
            raise DataConfigError(f"{where}: tags.{key} is {value!r}; expected a non-empty string.")
    tags = {**_DEFAULT_TAGS[formatting], **given}
    roles = [tags[k] for k in TAG_KEYS[2:]]
    if len(set(roles)) != len(roles):
        listing = ", ".join(f"{k}={tags[k]!r}" for k in TAG_KEYS[2:])
        raise DataConfigError(f"{where}: two roles share one tag value ({listing}).")
    return tags


def _reject_unknown(where: str, kind: str, given: dict, known: tuple[str, ...]) -> None:
    unknown = [k for k in given if k not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise DataConfigError(f"{where} has unknown {kind}(s) {', '.join(hints)}. Known: {', '.join(known)}.")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "y", "yes")
