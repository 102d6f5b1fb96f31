"""Paths in a config made absolute once, where the config is read: a Ray Train worker, an RL actor
or a Serve replica runs in a directory of its own (or on another machine)."""

from __future__ import annotations

import os

from fabric.ray_args import default_storage


def resolve_paths(run) -> None:
    """Every local path of a RunConfig made absolute, in place: Ray Train workers and Serve
    replicas do not run in the driver's directory. Hub ids and URIs stay as they are."""
    model, tuning, data = run.model, run.finetuning, run.data
    if run.training.values.get("output_dir"):
        run.training.values["output_dir"] = _absolute(run.training.values["output_dir"])
        if run.ray.ray_storage_path is None:  # Ray Train's checkpoint copies go inside the run's own output_dir
            run.ray.ray_storage_path = default_storage(run.training.values["output_dir"])
    if run.export.export_dir:
        run.export.export_dir = _absolute(run.export.export_dir)
    if run.inference.lora_modules:
        run.inference.lora_modules = {k: _absolute_if_local(v) for k, v in run.inference.lora_modules.items()}
    if model.cache_dir:
        model.cache_dir = _absolute(model.cache_dir)
    if data.tokenized_path:
        data.tokenized_path = _absolute(data.tokenized_path)
    model.model_name_or_path = _absolute_if_local(model.model_name_or_path)
    data.dataset_dir = _absolute_if_local(data.dataset_dir)
    for obj, name in ((tuning, "ref_model"), (tuning, "reward_model")):
        setattr(obj, name, _absolute_if_local(getattr(obj, name)))
    adapter_lists = ((model, "adapter_name_or_path"), (tuning, "ref_model_adapters"), (tuning, "reward_model_adapters"))
    for obj, name in adapter_lists:
        if getattr(obj, name):
            setattr(obj, name, [_absolute_if_local(p) for p in getattr(obj, name)])


def unpin_run_defaults(resolved: dict) -> dict:
    """RunConfig.resolved()'s values, with what a saved config must not repeat as it stands: a
    default ray_storage_path (output_dir/ray_results) goes back to unset, to follow whatever
    output_dir a repeat is given, and overwrite_output_dir goes, so that repeating a saved run never
    replaces one unasked (cluster/replaced_run.py)."""
    resolved.pop("overwrite_output_dir", None)
    if resolved.get("output_dir") and resolved.get("ray_storage_path") == default_storage(resolved["output_dir"]):
        resolved["ray_storage_path"] = None
    return resolved


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _absolute_if_local(path: str | None) -> str | None:
    """A hub id such as Qwen/Qwen3-0.6B stays as it is; an existing local path becomes absolute."""
    return _absolute(path) if path and os.path.exists(os.path.expanduser(path)) else path
