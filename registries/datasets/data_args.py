"""DataArguments: the data half of a training config, with LLaMA-Factory's names and defaults.

A LLaMA-Factory YAML's data keys load unchanged. Values arrive from YAML or the command line,
so list-valued options also accept LLaMA-Factory's comma-separated strings. There is no seed
here on purpose: shuffling, sampling and splitting take the run's seed as an argument.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import DataConfigError

MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over")
# Where the data is read, aligned and tokenized (fabric/data/prepare.py decides "auto" by size).
PREPROCESSING_ENGINES = ("auto", "driver", "ray_data")


@dataclass
class DataArguments:
    template: str | None = None  # a chat template's name (registries/templates), or auto: the tokenizer's own
    dataset: list[str] | None = None  # names in dataset_info.json; "a,b" is accepted
    eval_dataset: list[str] | None = None  # names in dataset_info.json, evaluated at eval_steps
    dataset_dir: str = "data"  # the folder holding dataset_info.json and the data files
    cutoff_len: int = 2048  # tokens per example at most; longer ones are cut as LLaMA-Factory cuts them
    train_on_prompt: bool = False  # also train on the prompt tokens (sft)
    mask_history: bool = False  # train on the last answer only, not the earlier turns'
    # Several datasets: concat, interleave_under (ends with the shortest), interleave_over (the longest).
    mix_strategy: str = "concat"
    interleave_probs: list[float] | None = None  # interleave: each dataset's sampling probability
    max_samples: int | None = None  # per dataset, after num_samples
    val_size: float = 0.0  # a fraction in (0, 1) or a row count >= 1
    packing: bool | None = None  # None: the stage decides (pt packs, the others do not)
    neat_packing: bool = False  # packing without attention across the packed examples
    # RayFactory's own: training batches (pt, sft, rm, dpo, kto) laid end to end with restarting
    # position ids instead of padded (the same gradient, no compute on pads). null: on where the
    # model supports it.
    padding_free: bool | None = None
    # LLaMA-Factory's image budget (its defaults): each picture is resized to at most / at least this
    # many pixels before the vision processor; fewer pixels, fewer image tokens per picture.
    image_max_pixels: int = 768 * 768
    image_min_pixels: int = 32 * 32  # see image_max_pixels
    tool_format: str | None = None  # how tool calls are written (registries/templates/tools); None: the template's
    default_system: str | None = None  # the system prompt when a row has none; None: the template's
    enable_thinking: bool | None = True  # reasoning templates (qwen3, ...): false writes an empty thinking block
    # RayFactory's own: special-token spellings in user and tool text (a user typing <|im_end|>):
    # false encodes them as the special tokens (LLaMA-Factory's behaviour, the data author is
    # trusted), true as plain text. null: false for training data, true for inference requests
    # (chat, serve, the web UI), whose callers are not trusted.
    escape_special_tokens: bool | None = None
    tokenized_path: str | None = None  # save the tokenized dataset here, and load it from here on later runs
    overwrite_cache: bool = False  # tokenize again even when tokenized_path holds a matching dataset
    # Each train worker reads its own share of the training data as it trains, instead of holding
    # the whole tokenized dataset (corpora larger than a worker's memory); needs max_steps.
    streaming: bool = False
    buffer_size: int = 16384  # rows in each worker's local shuffle buffer while streaming
    # RayFactory's own: drop malformed rows (and report them) instead of stopping at the first.
    skip_bad_rows: bool = False
    # RayFactory's own: "driver" tokenizes in the driver process, "ray_data" in Ray Data tasks
    # across the cluster; "auto" picks the driver for small data files (the same rows either way).
    preprocessing_engine: str = "auto"

    def __post_init__(self) -> None:
        self.dataset = _name_list("dataset", self.dataset)
        self.eval_dataset = _name_list("eval_dataset", self.eval_dataset)
        for name in ("train_on_prompt", "mask_history", "neat_packing", "overwrite_cache", "skip_bad_rows", "streaming"):
            _check_bool(name, getattr(self, name))
        for name in ("packing", "enable_thinking", "padding_free", "escape_special_tokens"):
            if getattr(self, name) is not None:
                _check_bool(name, getattr(self, name))
        for name in ("template", "tool_format", "default_system", "tokenized_path"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                _fail(name, getattr(self, name), "a string")
        if not isinstance(self.dataset_dir, str) or not self.dataset_dir:
            _fail("dataset_dir", self.dataset_dir, "a folder path (it holds dataset_info.json)")
        if not _is_int(self.cutoff_len) or self.cutoff_len <= 0:
            _fail("cutoff_len", self.cutoff_len, "a positive integer (the maximum tokens per example)")
        for name in ("image_max_pixels", "image_min_pixels"):
            if not _is_int(getattr(self, name)) or getattr(self, name) <= 0:
                _fail(name, getattr(self, name), "a positive integer (pixels per image, e.g. 589824 = 768 x 768)")
        if self.image_min_pixels > self.image_max_pixels:
            raise DataConfigError(
                f"Data arguments: image_min_pixels ({self.image_min_pixels}) is above image_max_pixels "
                f"({self.image_max_pixels}): pictures are resized to lie between the two. Lower image_min_pixels "
                "or raise image_max_pixels.")
        if self.max_samples is not None and (not _is_int(self.max_samples) or self.max_samples <= 0):
            _fail("max_samples", self.max_samples, "a positive integer, or null for all rows")
        if self.preprocessing_engine not in PREPROCESSING_ENGINES:
            _fail("preprocessing_engine", self.preprocessing_engine, f"one of {', '.join(PREPROCESSING_ENGINES)}")
        self._check_val_size()
        self._check_mixing()
        self._check_streaming()
        if self.mask_history and self.train_on_prompt:
            raise DataConfigError(
                "Data arguments: mask_history and train_on_prompt cannot both be true: mask_history "
                "trains only on the last response, train_on_prompt trains on every token. Set one to false."
            )
        if self.neat_packing:
            if self.packing is False:
                raise DataConfigError(
                    "Data arguments: neat_packing: true needs packing, but packing is false. "
                    "Remove packing: false (neat_packing turns packing on)."
                )
            self.packing = True

    def _check_val_size(self) -> None:
        v = self.val_size
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
            _fail("val_size", v, "a fraction in (0, 1) or a row count >= 1 (0 for no validation split)")
        if 1 < v and not float(v).is_integer():
            _fail("val_size", v, "a fraction in (0, 1) or a whole row count >= 1")
        if v == 1 and isinstance(v, float):
            _fail("val_size", v, "a fraction below 1 (1.0 would leave nothing to train on); for one row write 1")
        if v > 0 and self.dataset is None:
            raise DataConfigError("Data arguments: val_size is set but no dataset is given to split. Set dataset.")
        if v > 0 and self.eval_dataset is not None:
            raise DataConfigError(
                "Data arguments: val_size and eval_dataset are both set; the validation set would be "
                "ambiguous. Use one: val_size to split the training data, or eval_dataset."
            )

    def _check_mixing(self) -> None:
        if self.mix_strategy not in MIX_STRATEGIES:
            _fail("mix_strategy", self.mix_strategy, f"one of {', '.join(MIX_STRATEGIES)}")
        if self.interleave_probs is None:
            return
        if self.mix_strategy == "concat":
            raise DataConfigError(
                "Data arguments: interleave_probs is set but mix_strategy is 'concat', which does not "
                "sample. Set mix_strategy to interleave_under or interleave_over, or remove interleave_probs."
            )
        probs = self.interleave_probs
        if isinstance(probs, str):
            probs = [p.strip() for p in probs.split(",")]
        try:
            probs = [float(p) for p in probs]
        except (TypeError, ValueError):
            _fail("interleave_probs", self.interleave_probs, "numbers, e.g. '0.7,0.3' or [0.7, 0.3]")
        if any(p <= 0 or math.isnan(p) for p in probs) or abs(sum(probs) - 1.0) > 1e-6:
            _fail("interleave_probs", self.interleave_probs, "positive numbers that sum to 1")
        for name in ("dataset", "eval_dataset"):
            names = getattr(self, name)
            if names is not None and len(names) != len(probs):
                raise DataConfigError(
                    f"Data arguments: interleave_probs has {len(probs)} values but {name} names "
                    f"{len(names)} datasets ({', '.join(names)}). Give one probability per dataset."
                )
        self.interleave_probs = probs

    def _check_streaming(self) -> None:
        if not _is_int(self.buffer_size) or self.buffer_size <= 0:
            _fail("buffer_size", self.buffer_size, "a positive integer (rows in the shuffle buffer)")
        if not self.streaming:
            return
        # What streaming cannot do: each needs every row before the first batch.
        conflicts = [
            (self.val_size, "val_size", "splitting off a validation share needs the row count; use eval_dataset"),
            (self.mix_strategy != "concat", "mix_strategy " + repr(self.mix_strategy),
             "interleaving plans over every dataset's length; use mix_strategy: concat"),
            (self.tokenized_path, "tokenized_path", "a streamed dataset is never stored whole; remove tokenized_path"),
            (self.preprocessing_engine == "driver", "preprocessing_engine 'driver'",
             "a stream is read by Ray Data tasks as the workers train; remove preprocessing_engine"),
        ]
        for active, name, why in conflicts:
            if active:
                raise DataConfigError(
                    f"Data arguments: streaming: true cannot be combined with {name}: {why}, or set streaming: false."
                )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DataArguments":
        """Build from a config mapping that holds only data keys; unknown keys are an error."""
        known = set(cls.field_names())
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            raise DataConfigError(
                f"Data arguments: unknown option(s) {', '.join(unknown)}. Known options: {', '.join(sorted(known))}."
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _name_list(option: str, value: Any) -> list[str] | None:
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        _fail(option, given, "dataset names: a comma-separated string or a list of strings")
    names = [v.strip() for v in value]
    if not names or any(not n for n in names):
        _fail(option, given, "non-empty dataset names (check for a stray comma)")
    return names


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(option: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(option, value, "true or false")


def _fail(option: str, value: Any, expected: str) -> None:
    raise DataConfigError(f"Data arguments: {option} is {value!r}; expected {expected}.")
