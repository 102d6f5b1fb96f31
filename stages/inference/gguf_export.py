"""A merged model as one GGUF file (llama.cpp, Ollama, LM Studio): weights, tokenizer and chat template.

Written with the ``gguf`` package (llama.cpp's own writer), in llama.cpp's tensor names and layout:
* architectures: llama (and mistral, which llama.cpp runs as llama), qwen2, qwen3. Llama's q/k
  projections are stored with their rotary halves interleaved, as llama.cpp's converter does
  (HF keeps the halves apart; llama.cpp's rope is the interleaved one); qwen's are not;
* the tokenizer: byte-level BPE (``tokenizer.json``) as the "gpt2" model with its merges, its
  pre-tokenizer named after the split pattern it uses (llama.cpp has no regex field), special
  tokens as control tokens, and the training template as ``tokenizer.chat_template`` (Jinja);
* types: f32, f16, bf16, q8_0 for 2-D weights (q8_0 where a row is whole 32-value blocks, else
  f16); norms and biases stay f32, as llama.cpp's converter keeps them.

Anything else (a sentencepiece tokenizer, another architecture) is refused up front, naming what is.
"""

from __future__ import annotations

import json
import os

from registries.errors import UserError

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# tokenizer.json's split regex -> llama.cpp's pre-tokenizer of the same rule (llama-vocab.cpp)
_PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
}


class GGUFExportError(UserError):
    """A model or tokenizer this GGUF writer cannot write faithfully."""


def check_gguf_model(config, tokenizer) -> str:
    """The llama.cpp architecture of this model; refuses what cannot be written faithfully."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise GGUFExportError(
            f"export_format: gguf writes the architectures {', '.join(sorted(ARCHITECTURES))}; this model is "
            f"{model_type!r}. Export with export_format: safetensors and convert that folder with llama.cpp's "
            "convert_hf_to_gguf.py."
        )
    pre_tokenizer(tokenizer)  # refuses a tokenizer it cannot describe
    return ARCHITECTURES[model_type]


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for this tokenizer's pre-tokenization."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    if (state.get("model") or {}).get("type") != "BPE":
        raise GGUFExportError(
            "export_format: gguf writes byte-level BPE tokenizers (tokenizer.json with a BPE model); this one is "
            f"{(state.get('model') or {}).get('type')!r}. Export with export_format: safetensors and convert that "
            "folder with llama.cpp's convert_hf_to_gguf.py."
        )
    pre = state.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    splits = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
    if splits and splits[0] in _PRE_TOKENIZERS:
        return _PRE_TOKENIZERS[splits[0]]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"  # ByteLevel's own split is GPT-2's regex
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"  # GPT-2's split after single digits (SmolLM, StarCoder)
    raise GGUFExportError(
        "export_format: gguf does not know the pre-tokenizer of this tokenizer (its split rule has no llama.cpp "
        "name here), and a wrong one would tokenize text differently in llama.cpp. Export with export_format: "
        "safetensors and convert that folder with llama.cpp's convert_hf_to_gguf.py."
    )


def write_gguf(model, tokenizer, chat_template: str, stop_token_ids: list[int], path: str, gguf_type: str,
               name: str) -> str:
    """Write ``model`` (a merged causal LM) and its tokenizer as one GGUF file at ``path``."""
    import gguf

    config = model.config.get_text_config()
    arch_name = check_gguf_model(config, tokenizer)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_name(name)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _hyperparameters(writer, config)
    _tokenizer(writer, tokenizer, chat_template, stop_token_ids)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses token_embd when output is absent
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GGUFExportError(f"export_format: gguf has no llama.cpp name for the weight {hf_name} of this model.")
        data = tensor.detach().float()
        if arch_name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            data = _interleave_rotary_halves(data, heads)
        array, qtype = _encode(data.numpy(), gguf_type)
        writer.add_tensor(gguf_name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hyperparameters(writer, config) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    writer.add_rope_freq_base(float(theta or getattr(config, "rope_theta", 10000.0)))
    kind = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if kind not in ("default", None):
        raise GGUFExportError(f"export_format: gguf writes models with plain rotary positions; this one uses "
                              f"rope_type {kind!r}.")


def _tokenizer(writer, tokenizer, chat_template: str, stop_token_ids: list[int]) -> None:
    import gguf

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    size = max(len(tokenizer), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, token_id in vocab.items():
        tokens[token_id], types[token_id] = text, gguf.TokenType.NORMAL
    for token in state.get("added_tokens", []):
        types[token["id"]] = gguf.TokenType.CONTROL if token.get("special") else gguf.TokenType.USER_DEFINED
    merges = state["model"].get("merges", [])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    # What the tokenizer's post-processor does, whatever its add_bos_token attribute says.
    adds_bos = tokenizer.bos_token_id is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
    writer.add_add_bos_token(adds_bos)
    writer.add_eos_token_id(stop_token_ids[0] if stop_token_ids else tokenizer.eos_token_id)
    if len(stop_token_ids) > 1:
        writer.add_eot_token_id(stop_token_ids[0])
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(chat_template)


def _interleave_rotary_halves(weight, heads: int):
    """HF's q/k rows per head are [first halves of the pairs..., second halves...]; llama.cpp's
    llama rope rotates adjacent pairs, so each head's rows are interleaved (convert_hf_to_gguf's permute)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _encode(array, gguf_type: str):
    import gguf
    import numpy as np

    if array.ndim < 2 or gguf_type == "f32":
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if gguf_type == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
    else:
        qtype = {"bf16": gguf.GGMLQuantizationType.BF16}.get(gguf_type, gguf.GGMLQuantizationType.F16)
    return gguf.quants.quantize(array, qtype), qtype


def check_gguf_export(spec, tokenizer) -> None:
    """Refuse, before anything is written, a model or tokenizer this writer cannot write."""
    from transformers import AutoConfig

    from ..loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(spec.model.model_name_or_path),
                                        trust_remote_code=spec.model.trust_remote_code,
                                        revision=spec.model.model_revision, cache_dir=spec.model.cache_dir)
    check_gguf_model(config.get_text_config(), tokenizer)


def write_gguf_export(out: str, model, tokenizer, template, generating, gguf_type: str, log=print) -> dict:
    """The GGUF file and the Ollama Modelfile next to an export; what was written, for its note."""
    from registries.templates.jinja import to_jinja
    from registries.templates.ollama import modelfile

    name = os.path.basename(os.path.normpath(out)) or "model"
    gguf_file = f"{name}-{gguf_type}.gguf"
    stop_ids = template.stop_token_ids(tokenizer)
    write_gguf(model, tokenizer, to_jinja(template, tokenizer), stop_ids, os.path.join(out, gguf_file), gguf_type, name)
    stops = [tokenizer.convert_ids_to_tokens(i) for i in stop_ids]
    parameters = {"temperature": generating.temperature if generating.do_sample else 0, "top_p": generating.top_p, "top_k": generating.top_k,
                  "repeat_penalty": generating.repetition_penalty, "num_predict": generating.max_new_tokens}
    try:
        text = modelfile(gguf_file, template, tokenizer, stops, parameters)
    except ValueError as exc:  # the template cannot be said in Ollama's terms: the GGUF's own Jinja template serves
        log(f"note: the Modelfile has no TEMPLATE: {exc}; Ollama reads the chat template inside the GGUF instead.")
        text = f"FROM ./{gguf_file}\n" + "".join(f'PARAMETER stop "{w}"\n' for w in stops)
    with open(os.path.join(out, "Modelfile"), "w", encoding="utf-8") as f:
        f.write(text)
    return {"file": gguf_file, "type": gguf_type, "modelfile": "Modelfile"}
