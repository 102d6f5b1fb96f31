"""``rayfactory export cfg.yaml [key=value ...]``: merge adapters into the base, write a standalone model.

LLaMA-Factory's ``llamafactory-cli export``: model_name_or_path + adapter_name_or_path (+ template)
in, ``export_dir`` out (``export_size``, ``export_legacy_format``). Runs in this process: no Ray.
"""

from __future__ import annotations

import argparse
import os

from .config import ConfigError, load_config


def run_export(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides, purpose="infer")
    if not cfg.export.export_dir:
        raise ConfigError(
            f"export_dir is missing in {cfg.source}. Set the folder that receives the merged model, e.g. "
            "export_dir: saves/merged (or add export_dir=saves/merged to the command line)."
        )
    for note in cfg.notes:  # LLaMA-Factory keys that mean something else here, or nothing
        print(f"note: {note}")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the file list below says what was written
    from stages.inference.export import check_export_request, export_model

    spec = cfg.inference_spec()
    check_export_request(spec, cfg.export)  # refused before anything loads or prints
    adapters = ", ".join(spec.adapters) or "none"
    print(f"rayfactory export: {spec.model.model_name_or_path} + adapters [{adapters}] -> {cfg.export.export_dir}")
    files = export_model(spec, cfg.export)
    total = sum(os.path.getsize(os.path.join(cfg.export.export_dir, name)) for name in files)
    print(f"wrote {len(files)} files ({total / 2**20:.1f} MiB) to {cfg.export.export_dir}:")
    for name in files:
        print(f"  {name}")
    return 0
