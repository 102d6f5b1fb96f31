"""Every model or adapter path of a config that looks local must exist: transformers and peft take
a missing path for a hub id and fail much later (on a worker, in a Serve replica, after a hub
lookup), so load_config names it first (a rule in cluster/config_rules.py)."""

from __future__ import annotations

import os

from .config_types import ConfigError


def check_local_paths(cfg) -> None:
    tuning = cfg.finetuning
    # (key, how the refusal names it, path)
    named = [(key, key, path) for key, path in (("model_name_or_path", cfg.model.model_name_or_path),
                                                ("ref_model", tuning.ref_model), ("reward_model", tuning.reward_model))]
    for key, paths in (("adapter_name_or_path", cfg.model.adapter_name_or_path),
                       ("ref_model_adapters", tuning.ref_model_adapters),
                       ("reward_model_adapters", tuning.reward_model_adapters)):
        named += [(key, key, p) for p in paths or ()]
    named += [("lora_modules", f"lora_modules adapter {name!r}:", p)
              for name, p in (cfg.inference.lora_modules or {}).items()]
    for key, label, path in named:
        if path and looks_local(path) and not os.path.exists(os.path.expanduser(path)):
            if "adapter" in label:
                fix = "Point it at a folder holding adapter_config.json, or use a hub id of a PEFT adapter."
            else:
                fix = ("Point it at a model folder, use a hub id such as Qwen/Qwen2.5-0.5B-Instruct, tiny:qwen2 "
                       "for a tiny test model, or demo:smollm2-135m-instruct for a real small one.")
            raise ConfigError(
                f"{label} {path!r} does not exist (looked for {os.path.abspath(os.path.expanduser(path))}). {fix}",
                key=key,
            )


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id ('name' or 'org/name'), tiny:<family> or demo:<name>."""
    if "://" in path or path.startswith(("tiny:", "demo:")):
        return False
    return path.startswith(("/", "./", "../", "~", ".\\")) or path.count("/") > 1 or "\\" in path
