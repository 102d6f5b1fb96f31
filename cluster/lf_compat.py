"""LLaMA-Factory compatibility: its keys that mean nothing here, features we refuse, and
spellings we translate, so its YAML files load unchanged."""

from __future__ import annotations

from typing import Any

from .config_types import ConfigError, coerce_key

# Keys LLaMA-Factory YAMLs carry that mean nothing here: accepted, dropped, and reported as a note.
IGNORED_KEYS = {
    "preprocessing_num_workers": "Ray Data sizes the preprocessing parallelism itself (see preprocessing_engine)",
    "preprocessing_batch_size": "Ray Data picks the preprocessing batch size",
    "master_addr": "Ray Train sets up the process group",
    "master_port": "Ray Train sets up the process group",
    "ignore_pad_token_for_loss": "padding never counts in the loss",
    "use_fast_tokenizer": "the fast tokenizer is always used",
    "low_cpu_mem_usage": "transformers 5 always loads this way",
    "data_shared_file_system": "Ray Data tokenizes once for all nodes",
    "print_param_status": "the trainable-parameter count is always logged",
    "hf_hub_token": "set HF_TOKEN in the environment instead (secrets stay out of saved configs)",
    # llamafactory-cli eval's: the harness's datasets library reuses what it has downloaded
    "download_mode": "lm-evaluation-harness reuses the task data it has downloaded (HF_DATASETS_CACHE)",
    # LLaMA-Factory's export_quantization_bit is GPTQ, calibrated on a dataset; ours is bitsandbytes
    "export_quantization_dataset": "export_quantization_bit saves bitsandbytes weights, which need no calibration data",
    "export_quantization_nsamples": "export_quantization_bit saves bitsandbytes weights, which need no calibration data",
    "export_quantization_maxlen": "export_quantization_bit saves bitsandbytes weights, which need no calibration data",
}
# LLaMA-Factory features not built here. Accepted only when off, so a YAML that lists them
# still loads, and one that turns them on fails instead of quietly training something else.
UNSUPPORTED_KEYS = (
    "use_unsloth", "use_unsloth_gc", "enable_liger_kernel", "use_galore", "use_apollo", "use_badam",
    "use_llama_pro", "use_adam_mini", "use_muon", "pissa_init", "pissa_convert", "use_dft_loss",
    "use_asft_loss", "use_eaft_loss", "use_mca", "use_kt", "use_swanlab", "shift_attn",
    "mixture_of_depths", "rope_scaling", "loraplus_lr_ratio", "create_new_adapter", "add_tokens",
    "add_special_tokens", "upcast_layernorm", "upcast_lmhead_output", "train_from_scratch",
    "compute_accuracy", "pure_bf16", "media_dir", "fp8",
)
# image_max_pixels / image_min_pixels are data arguments here; freeze_vision_tower,
# freeze_multi_modal_projector, freeze_language_model and train_mm_proj_only fine-tuning ones.
# The video and audio settings below are accepted and ignored with a note (no video or audio is read).
MULTIMODAL_KEYS = (
    "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video", "audio_sampling_rate",
)
FLASH_ATTN = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2", "fa3": "flash_attention_3"}


def apply_lf_compat(values: dict[str, Any], origin: dict[str, str]) -> list[str]:
    """Drop ignored keys and translate LLaMA-Factory spellings in place; return the notes."""
    notes = []
    for key in list(values):
        if key in IGNORED_KEYS:
            values.pop(key)
            notes.append(f"ignored {key!r} from {origin[key]}: {IGNORED_KEYS[key]}.")
        elif key in UNSUPPORTED_KEYS and values.pop(key) not in (None, False):
            raise ConfigError(
                f"{key!r} in {origin[key]} turns on a LLaMA-Factory feature that RayFactory does not "
                f"support (yet). Remove {key} from the config."
            )
        elif key in MULTIMODAL_KEYS:
            # Inert here: a dataset with a videos or audios column is refused when its
            # dataset_info.json entry is read (registries/datasets/info.py), so no video or audio
            # reaches a run these settings could shape. LLaMA-Factory's qwen2vl example sets one.
            values.pop(key)
            notes.append(f"ignored {key!r} from {origin[key]}: RayFactory reads images, not video or audio "
                         "(a dataset with a videos or audios column is refused).")

    def move(old: str, old_value: Any, new: str, value: Any, meaning: str = "") -> None:
        if new in values:
            raise ConfigError(
                f"{old!r} in {origin[old]} and {new!r} in {origin[new]} set the same thing "
                f"({old} is LLaMA-Factory's name for {new}). Keep only one of them."
            )
        values[new] = value
        origin[new] = origin[old]
        notes.append(f"translated {old}: {old_value!r} to {new}: {value!r}{meaning}.")

    if values.get("export_quantization_bit"):
        notes.append(f"export_quantization_bit {values['export_quantization_bit']} saves bitsandbytes "
                     f"{'int8' if values['export_quantization_bit'] == 8 else 'nf4'} weights (LLaMA-Factory's is GPTQ, "
                     "which needs a GPU): transformers loads them back as they are.")
    if values.get("template") == "fewshot":  # LLaMA-Factory's plain-text format for llamafactory-cli eval
        values.pop("template")
        notes.append(f"template: fewshot from {origin['template']} is LLaMA-Factory's plain-text eval format: "
                     "rayfactory eval scores plain text unless apply_chat_template is true, so no template is set.")
    if values.get("finetuning_type") == "qlora":  # LLaMA-Factory spells QLoRA as lora + quantization_bit
        values["finetuning_type"] = "lora"
        if values.get("quantization_bit") is None:
            values["quantization_bit"] = 4
            origin["quantization_bit"] = origin["finetuning_type"]
        notes.append(f"finetuning_type qlora means lora with quantization_bit {values['quantization_bit']}.")
    if "warmup_ratio" in values:  # transformers 5 folded it into warmup_steps: a float below 1 is a ratio
        ratio = coerce_key("warmup_ratio", values.pop("warmup_ratio"), float, origin["warmup_ratio"])
        if not 0 <= ratio < 1:
            raise ConfigError(
                f"warmup_ratio is {ratio} in {origin['warmup_ratio']}; it must be in [0, 1) (a fraction of "
                "the training steps). For a step count use warmup_steps."
            )
        move("warmup_ratio", ratio, "warmup_steps", float(ratio),
             f": transformers 5 reads a warmup_steps below 1 as a fraction of the total steps, so the warmup is "
             f"{ratio * 100:g}% of the training steps, as warmup_ratio meant" if ratio else "")
    if "group_by_length" in values:  # transformers 5 made it one choice of train_sampling_strategy
        where = origin["group_by_length"]
        if coerce_key("group_by_length", values.pop("group_by_length"), bool, where):
            move("group_by_length", True, "train_sampling_strategy", "group_by_length")
        else:
            notes.append(f"ignored 'group_by_length: false' from {where}: batches are sampled at random by default.")
    if "disable_gradient_checkpointing" in values:
        # LLaMA-Factory checkpoints unless told not to; here the memory planner decides when
        # gradient_checkpointing is unset (stages/training/memory_plan.py), so only a true says something.
        where = origin["disable_gradient_checkpointing"]
        disable = coerce_key("disable_gradient_checkpointing", values.pop("disable_gradient_checkpointing"), bool, where)
        if disable:
            move("disable_gradient_checkpointing", True, "gradient_checkpointing", False)
        else:
            notes.append(
                f"ignored 'disable_gradient_checkpointing' from {where}: false leaves gradient checkpointing to "
                "the memory planner (on when the model would not fit without it; gradient_checkpointing: true forces it)."
            )
    if "flash_attn" in values:
        choice = values.pop("flash_attn")
        if choice not in FLASH_ATTN:
            raise ConfigError(
                f"wrong value for 'flash_attn' in {origin['flash_attn']}: got {choice!r}, expected one of "
                f"{', '.join(map(repr, FLASH_ATTN))}; or set attn_implementation instead."
            )
        if FLASH_ATTN[choice] is not None:
            move("flash_attn", choice, "attn_implementation", FLASH_ATTN[choice])
    return notes
