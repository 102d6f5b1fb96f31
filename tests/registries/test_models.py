"""Model-family registry and tiny offline models (registries/models)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from registries.models import (
    build_tiny_model,
    default_template_for,
    family_for_config,
    get_model_family,
    is_tiny_tokenizer,
    list_model_families,
    load_tokenizer,
    register_model_family,
    tiny_model_path,
)
from registries.models import families as families_module
from registries.models import tiny as tiny_module
from registries.templates import get_template, list_templates

FAMILIES = list_model_families()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict:
    """One default tiny model per family, built once for the whole file."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny_model(name, root / name) for name in FAMILIES}


# ---------------------------------------------------------------------------- the registry


def test_expected_families_are_registered():
    assert FAMILIES == [
        "gemma", "gemma2", "gemma3", "gemma3_vl", "llama", "llava", "mistral", "phi3", "qwen2", "qwen2_vl", "qwen3",
    ]
    assert [name for name in FAMILIES if get_model_family(name).vision] == ["gemma3_vl", "llava", "qwen2_vl"]


def test_default_templates_follow_llamafactory_names():
    got = {mt: default_template_for(mt) for mt in
           ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3", "qwen2_vl"]}
    assert got == {
        "llama": "llama3", "qwen2": "qwen", "qwen3": "qwen3", "mistral": "mistral", "gemma": "gemma",
        "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3", "phi3": "phi", "qwen2_vl": "qwen2_vl",
    }


def test_family_for_config_accepts_configs_dicts_and_strings():
    assert family_for_config(transformers.Qwen2Config()).name == "qwen2"
    assert family_for_config(transformers.Gemma3TextConfig()).name == "gemma3"
    # model_type gemma3 is the multimodal wrapper (Gemma3ForConditionalGeneration), gemma3_text the text model
    assert family_for_config({"model_type": "gemma3"}).name == "gemma3_vl"
    assert family_for_config("llama").name == "llama"


def test_unknown_model_type_error_says_what_to_do():
    with pytest.raises(ValueError) as err:
        family_for_config(transformers.GPT2Config())
    message = str(err.value)
    assert "No model family knows model_type 'gpt2'." in message
    assert "Set `template:` in your YAML" in message
    expected = r"model_type 'qwen'\. Did you mean 'qwen3', 'qwen2', 'qwen2_vl'\? Known model types: gemma, "
    with pytest.raises(ValueError, match=expected):
        family_for_config("qwen")


def test_config_without_model_type_is_a_clear_error():
    with pytest.raises(ValueError, match=r"the config \(dict\) has no model_type\. Check that config\.json"):
        family_for_config({"hidden_size": 8})


def test_unknown_family_name_suggests_close_ones():
    expected = r"Unknown model family 'gemma4'\. Did you mean 'gemma', 'gemma3', 'gemma2'\? Known families: gemma, "
    with pytest.raises(ValueError, match=expected):
        get_model_family("gemma4")


def test_registry_rejects_duplicates_and_bad_declarations(monkeypatch):
    monkeypatch.setattr(families_module, "MODEL_FAMILIES", {})
    monkeypatch.setattr(families_module, "_BY_MODEL_TYPE", {})
    fam = register_model_family("toy", config_class="LlamaConfig", model_types=["toy", "toy2"],
                                template="empty", eos_token="</s>")
    assert family_for_config("toy2") is fam
    with pytest.raises(ValueError, match=r"^Model family 'toy' is already registered\.$"):
        register_model_family("toy", config_class="LlamaConfig", model_types=["other"], template="empty",
                              eos_token="</s>")
    with pytest.raises(ValueError, match=r"model_type 'toy2' of family 'toy3' is already claimed by family 'toy'\."):
        register_model_family("toy3", config_class="LlamaConfig", model_types=["toy2"], template="empty",
                              eos_token="</s>")
    with pytest.raises(ValueError, match=r"'toy4' sets add_bos but has no bos_token"):
        register_model_family("toy4", config_class="LlamaConfig", model_types=["t4"], template="empty",
                              eos_token="</s>", add_bos=True)
    with pytest.raises(ValueError, match=r"'toy5' lists \['<x>'\] as both chat and plain tokens"):
        register_model_family("toy5", config_class="LlamaConfig", model_types=["t5"], template="empty",
                              eos_token="</s>", chat_tokens=["<x>"], plain_tokens=["<x>"])
    assert sorted(families_module.MODEL_FAMILIES) == ["toy"]  # failed calls registered nothing


@pytest.mark.parametrize("name", FAMILIES)
def test_config_class_exists_and_matches_its_model_type(name):
    family = get_model_family(name)
    config_class = getattr(transformers, family.config_class)
    assert config_class.model_type in family.model_types


def test_special_tokens_are_ordered_and_unique():
    assert get_model_family("qwen2").special_tokens == ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
    assert get_model_family("llama").special_tokens[:3] == ("<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>")
    assert get_model_family("gemma").special_tokens == (
        "<bos>", "<eos>", "<pad>", "<unk>", "<start_of_turn>", "<end_of_turn>")
    assert get_model_family("gemma3").special_tokens == (
        "<bos>", "<end_of_turn>", "<pad>", "<unk>", "<eos>", "<start_of_turn>")


@pytest.mark.parametrize("name", FAMILIES)
def test_default_template_is_registered(name):
    template = get_model_family(name).template
    assert template in list_templates()
    assert get_template(template).name == template


# ---------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_model_loads_runs_and_has_the_lora_targets(tiny_dirs, name):
    family = get_model_family(name)
    model = getattr(transformers, family.auto_class).from_pretrained(tiny_dirs[name])
    tokenizer = load_tokenizer(tiny_dirs[name])
    assert type(model.config).__name__ == family.config_class
    assert model.config.get_text_config().vocab_size == len(tokenizer)
    # The vision tower's linears (qkv, proj, fc1, fc2, the merger's; LLaVA's CLIP tower and projector)
    # are not LoRA targets.
    vision_parts = (".visual.", ".vision_tower.", ".multi_modal_projector.")
    linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and not any(part in f".{n}" for part in vision_parts)}
    assert linear_names == set(family.lora_targets) | {"lm_head"}

    ids = tokenizer("What is 12 + 7?", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_tokenizer_keeps_special_tokens_whole(tiny_dirs, name):
    family = get_model_family(name)
    tokenizer = load_tokenizer(tiny_dirs[name])
    # Special tokens take the first ids, in declaration order; plain tokens follow the BPE vocab.
    special_ids = [tokenizer.convert_tokens_to_ids(t) for t in family.special_tokens]
    assert special_ids == list(range(len(family.special_tokens)))
    a_id, b_id = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    for token in family.special_tokens + family.plain_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False) == [a_id, token_id, b_id]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        family.bos_token, family.eos_token, family.pad_token, family.unk_token)
    starts_with_bos = tokenizer("hi").input_ids[0] == tokenizer.bos_token_id
    assert starts_with_bos == family.add_bos
    assert tokenizer.model_max_length == 2048


@pytest.mark.parametrize("text", [
    "Hello, world! How are you today?",
    "  leading spaces\n\nand blank lines\ttabs",
    "naïve café — 東京 🚀",
    "def f(x):\n    return {'a': [1, 2]}",
])
def test_tiny_tokenizer_round_trips_text(tiny_dirs, text):
    tokenizer = load_tokenizer(tiny_dirs["llama"])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_numbers_are_spelled_digit_by_digit(tiny_dirs):
    tokenizer = load_tokenizer(tiny_dirs["qwen2"])
    digit_ids = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    assert len(set(digit_ids)) == 10
    assert tokenizer.encode("9081726354", add_special_tokens=False) == [digit_ids[int(d)] for d in "9081726354"]
    assert tokenizer.encode("12+7", add_special_tokens=False) == [
        digit_ids[1], digit_ids[2], tokenizer.convert_tokens_to_ids("+"), digit_ids[7]]


def test_plain_tokens_survive_skip_special_tokens(tiny_dirs):
    tokenizer = load_tokenizer(tiny_dirs["qwen3"])
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nok\n</think>\n\n7<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nok\n</think>\n\n7"


def test_same_seed_same_files_and_other_seed_other_weights(tiny_dirs, tmp_path):
    again = build_tiny_model("qwen2", tmp_path / "again")
    other = build_tiny_model("qwen2", tmp_path / "other", seed=1)
    first = tiny_dirs["qwen2"]
    weights = (first / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    assert (again / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_building_leaves_the_callers_random_state_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model("llama", tmp_path / "m", num_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_custom_corpus_and_sizes(tmp_path):
    path = build_tiny_model("gemma", tmp_path / "g", corpus=["abc abd abe"] * 5, vocab_size=300,
                            hidden_size=32, num_layers=1, num_heads=2)
    tokenizer = load_tokenizer(path)
    config = transformers.AutoConfig.from_pretrained(path)
    assert len(tokenizer) < 300  # the tiny corpus runs out of merges; the model follows the tokenizer
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (len(tokenizer), 32, 1)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 16)


def test_bad_sizes_are_rejected_before_building(tmp_path):
    with pytest.raises(ValueError, match=r"hidden_size \(60\) must be a multiple of num_heads \(8\)"):
        build_tiny_model("llama", tmp_path / "x", hidden_size=60, num_heads=8)
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------- loading tokenizers


def test_load_tokenizer_keeps_the_trained_pipeline(tiny_dirs, tmp_path):
    folder = tiny_dirs["qwen2"]
    assert is_tiny_tokenizer(folder)
    tokenizer = load_tokenizer(folder)
    assert type(tokenizer).__name__ == "TokenizersBackend"  # PreTrainedTokenizerFast in transformers 5
    saved = json.loads((folder / "tokenizer.json").read_text())
    assert json.loads(tokenizer.backend_tokenizer.to_str()) == saved

    # The marker survives a re-save (what every checkpoint of a fine-tuned tiny model does).
    tokenizer.save_pretrained(tmp_path / "resaved")
    assert is_tiny_tokenizer(tmp_path / "resaved")


def test_load_tokenizer_uses_autotokenizer_for_other_folders(tiny_dirs, tmp_path):
    real_like = tmp_path / "real"
    shutil.copytree(tiny_dirs["qwen2"], real_like)
    config_file = real_like / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["rayfactory_tiny"]
    config_file.write_text(json.dumps(config))
    assert not is_tiny_tokenizer(real_like)
    assert type(load_tokenizer(real_like)).__name__ == "Qwen2Tokenizer"  # AutoTokenizer's choice for qwen2
    assert not is_tiny_tokenizer(tmp_path / "missing")


@pytest.mark.parametrize("name", FAMILIES)
def test_autotokenizer_agrees_on_tiny_folders(tiny_dirs, name):
    # The tiny tokenizers share Qwen2's pre-tokenizer, which is what AutoTokenizer swaps in for
    # qwen2 folders, so code that bypasses load_tokenizer (vLLM, TRL) still gets identical ids.
    family = get_model_family(name)
    markers = "".join(family.special_tokens + family.plain_tokens)
    text = f"{markers}user\nWhat is 12 + 7?\n  {{\"a\": [1, 2]}}  end"
    ours, auto = load_tokenizer(tiny_dirs[name]), AutoTokenizer.from_pretrained(tiny_dirs[name])
    if name == "qwen2":
        assert type(auto).__name__ == "Qwen2Tokenizer"
    assert auto.encode(text) == ours.encode(text)
    marker_ids = [ours.convert_tokens_to_ids(t) for t in family.special_tokens + family.plain_tokens]
    assert auto.encode(text, add_special_tokens=False)[: len(marker_ids)] == marker_ids


# ---------------------------------------------------------------------------- templates on tiny tokenizers


def test_chatml_needs_no_new_tokens_on_tiny_qwen(tiny_dirs):
    tokenizer = load_tokenizer(tiny_dirs["qwen2"])
    assert get_template("chatml").fix_tokenizer(tokenizer) == []
    assert tokenizer.eos_token == "<|im_end|>"
    assert len(tokenizer) == 1026


@pytest.mark.parametrize("name", FAMILIES)
def test_default_template_needs_no_new_tokens(tiny_dirs, name):
    template = get_model_family(name).template
    tokenizer = load_tokenizer(tiny_dirs[name])
    size = len(tokenizer)
    assert get_template(template).fix_tokenizer(tokenizer) == []  # so no embedding resize
    assert len(tokenizer) == size


@pytest.mark.parametrize("name", FAMILIES)
def test_default_template_encodes_a_conversation_on_the_tiny_tokenizer(tiny_dirs, name):
    template_name = get_model_family(name).template
    template = get_template(template_name)
    tokenizer = load_tokenizer(tiny_dirs[name])
    template.fix_tokenizer(tokenizer)
    messages = [
        {"role": "user", "content": "What is 12 + 7?"},
        {"role": "assistant", "content": "19"},
        {"role": "user", "content": "And 3 * 4?"},
        {"role": "assistant", "content": "12"},
    ]
    pairs = template.encode_multiturn(tokenizer, messages, system="Be brief.")
    ids = [i for prompt, response in pairs for i in prompt + response]
    assert tokenizer.decode(ids) == template.render(tokenizer, messages, system="Be brief.")
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


# ---------------------------------------------------------------------------- the cache


def test_tiny_model_path_builds_once_and_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFACTORY_CACHE", str(tmp_path / "cache"))
    first = tiny_model_path("llama", num_layers=1)
    assert first.parent == tmp_path / "cache" / "tiny"
    assert first.name.startswith("llama-")
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    assert first.stat().st_mode & 0o777 == 0o755  # readable by other users of a shared cache

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached model was rebuilt")

    monkeypatch.setattr(tiny_module, "build_tiny_model", no_rebuild)
    assert tiny_model_path("llama", num_layers=1) == first
    assert tiny_model_path("llama", num_layers=1, seed=0, hidden_size=64) == first  # defaults spelled out
    with pytest.raises(AssertionError, match="rebuilt"):
        tiny_model_path("llama", num_layers=1, seed=1)  # other arguments, other folder


def test_concurrent_builders_both_get_one_complete_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFACTORY_CACHE", str(tmp_path))
    results, errors = [], []
    start = threading.Barrier(2)

    def build():
        try:
            start.wait()
            results.append(tiny_model_path("qwen3", num_layers=1))
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results[0] == results[1]
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == [results[0].name]  # no staging left
    assert AutoModelForCausalLM.from_pretrained(results[0]).config.num_hidden_layers == 1


def test_tiny_model_path_rejects_unknown_family_and_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFACTORY_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"Unknown model family 'qwen9'"):
        tiny_model_path("qwen9")
    with pytest.raises(TypeError, match="num_layer"):
        tiny_model_path("qwen2", num_layer=1)
    assert not (tmp_path / "tiny").exists() or list((tmp_path / "tiny").iterdir()) == []


def test_losing_the_publish_race_keeps_the_winners_folder(tmp_path):
    winner, loser = tmp_path / "final", tmp_path / ".staging"
    winner.mkdir()
    (winner / "config.json").write_text("winner")
    loser.mkdir()
    (loser / "config.json").write_text("loser")
    tiny_module.publish_folder(loser, winner)  # no error: the folder it wanted already exists
    assert (winner / "config.json").read_text() == "winner"
    tiny_module.publish_folder(loser, tmp_path / "fresh")
    assert (tmp_path / "fresh" / "config.json").read_text() == "loser" and not loser.exists()
