"""``rayfactory export``: merge the adapters into the base and write one standalone model folder.

LLaMA-Factory's export: every adapter of ``adapter_name_or_path`` is merged in order, the result
is written in shards of at most ``export_size`` GB (safetensors, or ``.bin`` with
``export_legacy_format``), next to the tokenizer with the training chat template and stop words,
and a ``generation_config.json`` that stops on the template's stop tokens. A reward model keeps
its value head. The folder loads in plain transformers and vLLM, with no RayFactory code.

Two more forms, beside that folder: ``export_format: gguf`` adds one GGUF file (llama.cpp,
Ollama) and an Ollama Modelfile (gguf_export.py); ``export_quantization_bit: 8 | 4`` saves the
folder's linear layers bitsandbytes-quantized (quantized_export.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import replace

from registries.errors import UserError
from registries.templates.jinja import to_jinja

from stages.training.value_head import VALUE_HEAD_FILE

from .gguf_export import check_gguf_export, write_gguf_export
from .inference_args import ExportArguments
from .loading import InferenceSpec, load_hf_model, load_tokenizer_and_template
from .quantized_export import quantize_export

# Written last into every export: marks a folder a later export may replace.
EXPORT_NOTE = "rayfactory_export.json"
GB = 10**9  # transformers' "5GB" means 5 * 10**9 bytes


class ExportError(UserError):
    """An export that cannot be written as configured."""


def export_model(spec: InferenceSpec, export: ExportArguments, log=print) -> list[str]:
    """Write the merged model into ``export.export_dir``; returns the files written."""
    check_export_request(spec, export)
    out = export.export_dir
    tokenizer, template = load_tokenizer_and_template(spec)
    if export.export_format == "gguf":  # refused before anything is written
        check_gguf_export(spec, tokenizer)
    if spec.model.quantization_bit:
        # The base on disk holds full weights (bitsandbytes quantizes at load time), so the merge
        # runs on those: merging into 4/8-bit weights would round the adapter away.
        log(f"note: quantization_bit {spec.model.quantization_bit} (QLoRA): the adapters are merged into the "
            "base loaded without quantization, so the export holds de-quantized (full-precision) weights.")
    # Only the adapters of adapter_name_or_path count: lora_modules are separate models, not merged.
    model, _, live = load_hf_model(replace(spec, inference=replace(spec.inference, lora_modules=None)), tokenizer)
    if export.export_device == "auto":
        import torch

        if torch.cuda.is_available():
            model = model.to("cuda")
    if live is not None:  # load_hf_model merged all but the last adapter; merge that one too
        model = model.merge_and_unload()

    model.generation_config.update(**spec.generating.to_generate_kwargs())
    model.generation_config.eos_token_id = template.stop_token_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    _clear_previous_export(out)
    model.save_pretrained(out, max_shard_size=max(1, int(export.export_size * GB)))
    if export.export_legacy_format:
        _safetensors_to_bin(out)

    tokenizer.chat_template = to_jinja(template, tokenizer)  # prompts formatted as in training
    tokenizer.save_pretrained(out)
    head = os.path.join(spec.output_folder, VALUE_HEAD_FILE)
    if os.path.isfile(head):  # a reward model: stages.loading.load_reward_model(export_dir) works
        shutil.copyfile(head, os.path.join(out, VALUE_HEAD_FILE))
    note = {"base_model": spec.model.model_name_or_path, "adapters": spec.adapters, "template": template.name,
            "dtype": str(model.dtype).removeprefix("torch."), "dequantized_from_bits": spec.model.quantization_bit}
    if export.export_format == "gguf":
        note["gguf"] = write_gguf_export(out, model, tokenizer, template, spec.generating, export.export_gguf_type, log)
    if export.export_quantization_bit:
        note["quantization"] = quantize_export(out, export.export_quantization_bit, export.export_size * GB)
    with open(os.path.join(out, EXPORT_NOTE), "w", encoding="utf-8") as f:  # last: the export is whole
        json.dump(note, f, indent=2)
    return sorted(os.listdir(out))


def check_export_request(spec: InferenceSpec, export: ExportArguments) -> None:
    """Everything that can be refused before a model is loaded."""
    if export.export_hub_model_id:
        raise ExportError(
            f"export_hub_model_id {export.export_hub_model_id!r}: pushing to the Hugging Face Hub is not built. "
            "Remove export_hub_model_id, export to export_dir, then upload that folder with "
            f"`huggingface-cli upload {export.export_hub_model_id} <export_dir>`."
        )
    for needed, package, extra in ((export.export_format == "gguf", "gguf", "gguf"),
                                   (bool(export.export_quantization_bit), "bitsandbytes", "qlora")):
        if needed and importlib.util.find_spec(package) is None:
            raise ExportError(
                f"{'export_format: gguf' if package == 'gguf' else 'export_quantization_bit'} needs the {package} "
                f"package, which is not installed. Install it with `pip install -e .[{extra}]` in the checkout."
            )
    if export.export_format == "gguf" and os.path.isfile(os.path.join(spec.output_folder, VALUE_HEAD_FILE)):
        raise ExportError(
            "export_format: gguf writes causal language models; this output is a reward model, whose value head "
            "a GGUF file cannot carry. Export it with export_format: safetensors."
        )
    if not export.export_dir:
        raise ExportError("export_dir is missing: set the folder to write the merged model into, e.g. "
                          "export_dir: saves/merged.")
    out = os.path.realpath(export.export_dir)
    sources = [*spec.adapters, spec.model.model_name_or_path]
    for source in sources:
        if source and os.path.exists(source) and os.path.realpath(source) == out:
            raise ExportError(
                f"export_dir {export.export_dir} is the model or adapter folder being exported ({source}); writing "
                "there would overwrite it. Choose a new folder for export_dir, e.g. saves/merged."
            )
    if os.path.isfile(out):
        raise ExportError(f"export_dir {export.export_dir} is a file. Choose a folder for export_dir.")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, EXPORT_NOTE)):
        raise ExportError(
            f"export_dir {export.export_dir} is not empty and holds no previous export ({EXPORT_NOTE} is missing), "
            "so RayFactory will not write into it: its files could be lost or mixed with the merged model's. "
            "Choose an empty or new folder for export_dir."
        )


def _clear_previous_export(out: str) -> None:
    """A previous export is replaced whole: its shards would otherwise mix with the new ones."""
    if os.path.isfile(os.path.join(out, EXPORT_NOTE)):
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)


def _safetensors_to_bin(out: str) -> None:
    """transformers 5 writes only safetensors: turn its shards (tied weights already dropped,
    names in the checkpoint format) into pytorch_model*.bin with the matching index."""
    import torch
    from safetensors.torch import load_file

    def bin_name(name: str) -> str:
        return "pytorch_model" + name[len("model"):].replace(".safetensors", ".bin")

    index_path = os.path.join(out, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        index["weight_map"] = {k: bin_name(v) for k, v in index["weight_map"].items()}
        with open(os.path.join(out, "pytorch_model.bin.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        os.remove(index_path)
    for name in sorted(os.listdir(out)):
        if name.startswith("model") and name.endswith(".safetensors"):
            torch.save(load_file(os.path.join(out, name)), os.path.join(out, bin_name(name)))
            os.remove(os.path.join(out, name))
