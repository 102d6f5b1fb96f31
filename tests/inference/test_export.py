"""``rayfactory export``: the merged folder stands alone (plain transformers, vLLM) and generates
exactly what ChatModel generates from base + adapter; shards, legacy .bin, reward heads, refusals."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from cluster.cli import main
from .conftest import BASE, PROMPTS, make_adapter_output

NEW_TOKENS = 12
SMALL_SHARD_GB = 0.0002  # the tiny model is ~0.8 MB: several shards


def export(tmp_path, name: str, **keys) -> int:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": BASE, "do_sample": False, **keys}))
    return main(["export", str(config)])


def make_reward_output(folder, seed: int) -> str:
    """An rm-style LoRA output: make_adapter_output's adapter + a random value head, saved by
    ValueHeadModel.save as stage rm saves."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from stages.loading import resolve_model_path
    from stages.training.value_head import ValueHeadModel

    folder = make_adapter_output(folder, seed)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(BASE), dtype=torch.float32)
    model = ValueHeadModel(PeftModel.from_pretrained(base, folder))
    torch.manual_seed(seed)
    with torch.no_grad():
        model.v_head.weight.normal_(std=1.0)
        model.v_head.bias.fill_(0.25)
    model.save(folder)
    return folder


def content(ids, stops) -> list[int]:
    """Generated ids up to (without) the first stop token: engines differ on keeping it."""
    ids = list(ids)
    for i, token in enumerate(ids):
        if token in stops:
            return ids[:i]
    return ids


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_adapter_output(tmp_path_factory.mktemp("export_adapter"), seed=1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, adapter):
    root = tmp_path_factory.mktemp("exported")
    out = root / "merged"
    assert export(root, "cfg", adapter_name_or_path=adapter, export_dir=str(out), export_size=SMALL_SHARD_GB) == 0
    return str(out)


@pytest.fixture(scope="module")
def reference(adapter):
    """ChatModel on base + live adapter (HF engine): prompt ids and greedy reply ids per prompt."""
    from cluster.api import ChatModel

    chat = ChatModel({"model_name_or_path": BASE, "adapter_name_or_path": adapter, "do_sample": False,
                      "max_new_tokens": NEW_TOKENS})
    try:
        stops = set(chat.stop_token_ids)
        return stops, [(chat.prompt_ids(p), content(chat.chat(p)[0].token_ids, stops)) for p in PROMPTS]
    finally:
        chat.close()


def test_export_loads_in_plain_transformers_and_generates_what_chat_model_does(exported, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stops, expected = reference
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert set(model.generation_config.eos_token_id) == stops  # plain generate() stops where ChatModel does
    assert model.generation_config.do_sample is False  # the config's generating keys
    for messages, (prompt_ids, reply_ids) in zip(PROMPTS, expected):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(ids) == prompt_ids  # the saved chat template is the training template
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert content(out[0, len(ids):].tolist(), stops) == reply_ids
    assert any(reply for _, reply in expected)  # the comparison saw real tokens


def test_export_is_sharded_by_export_size(exported):
    import json

    files = os.listdir(exported)
    shards = sorted(f for f in files if f.startswith("model-") and f.endswith(".safetensors"))
    assert len(shards) >= 3 and "model.safetensors.index.json" in files
    assert all(os.path.getsize(os.path.join(exported, f)) <= SMALL_SHARD_GB * 1e9 + 1e5 for f in shards)
    with open(os.path.join(exported, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"].values()) == set(shards)
    assert not any(f.startswith("adapter_") for f in files)  # merged, not an adapter


def test_export_generates_the_same_in_vllm(exported, reference, monkeypatch):
    from stages.engines.vllm_backend import ROLLOUT_ENV

    for key, value in ROLLOUT_ENV.items():  # os.environ.setdefault, undone when the test ends
        if key not in os.environ:
            monkeypatch.setenv(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stops, expected = reference
    llm = LLM(model=exported, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 * 2**20,
              max_model_len=256, skip_tokenizer_init=True, seed=0)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=sorted(stops), detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in expected], params, use_tqdm=False)
        assert [content(o.outputs[0].token_ids, stops) for o in outputs] == [reply for _, reply in expected]
    finally:
        del llm


def test_legacy_format_writes_bin_files_over_a_previous_export(tmp_path, adapter, exported):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "legacy"
    assert export(tmp_path, "st", adapter_name_or_path=adapter, export_dir=str(out)) == 0
    assert "model.safetensors" in os.listdir(out)
    # Exporting again into a previous export replaces it: no safetensors left beside the .bin shards.
    assert export(tmp_path, "bin", adapter_name_or_path=adapter, export_dir=str(out), export_legacy_format=True,
                  export_size=SMALL_SHARD_GB) == 0
    files = os.listdir(out)
    assert not any(f.endswith(".safetensors") for f in files)
    assert "pytorch_model.bin.index.json" in files and sum(f.endswith(".bin") for f in files) >= 3
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    with torch.no_grad():
        legacy = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(ids).logits
        safe = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(legacy, safe, rtol=0, atol=0)


def test_reward_model_export_keeps_its_value_head(tmp_path):
    from stages.training.value_head import VALUE_HEAD_FILE, score
    from stages.loading import load_reward_model

    reward = make_reward_output(tmp_path / "rm", seed=3)
    out = tmp_path / "rm_merged"
    assert export(tmp_path, "rm", adapter_name_or_path=reward, export_dir=str(out)) == 0
    assert VALUE_HEAD_FILE in os.listdir(out) and "adapter_config.json" not in os.listdir(out)
    ids = torch.tensor([[5, 17, 300, 42, 9, 1], [8, 8, 120, 3, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    merged, _ = load_reward_model(str(out))
    live, _ = load_reward_model(reward)
    expected = score(live, ids, mask)
    assert expected[0] != expected[1]
    torch.testing.assert_close(score(merged, ids, mask), expected, rtol=0, atol=1e-5)


def test_missing_export_dir_is_a_user_error(tmp_path, adapter, capsys):
    assert export(tmp_path, "none", adapter_name_or_path=adapter) == 2
    err = capsys.readouterr().err
    assert "export_dir is missing" in err and "none.yaml" in err


def test_export_refuses_to_write_into_the_adapter_or_a_foreign_folder(tmp_path, adapter, capsys):
    before = {f: os.path.getmtime(os.path.join(adapter, f)) for f in os.listdir(adapter)}
    assert export(tmp_path, "self", adapter_name_or_path=adapter, export_dir=adapter) == 2
    assert "is the model or adapter folder being exported" in capsys.readouterr().err
    assert {f: os.path.getmtime(os.path.join(adapter, f)) for f in os.listdir(adapter)} == before

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    assert export(tmp_path, "foreign", adapter_name_or_path=adapter, export_dir=str(foreign)) == 2
    assert "not empty and holds no previous export" in capsys.readouterr().err
    assert os.listdir(foreign) == ["todo.txt"]


def test_export_refuses_hub_and_gptq_widths_with_the_alternative(tmp_path, adapter, capsys):
    assert export(tmp_path, "hub", adapter_name_or_path=adapter, export_dir=str(tmp_path / "o"),
                  export_hub_model_id="me/model") == 2
    assert "not built" in capsys.readouterr().err
    assert export(tmp_path, "gptq", adapter_name_or_path=adapter, export_dir=str(tmp_path / "o"),
                  export_quantization_bit=3) == 2
    err = capsys.readouterr().err
    assert "export_quantization_bit is 8 or 4" in err and "GPTQModel" in err
    assert not os.path.exists(tmp_path / "o")


def test_an_adapter_trained_on_resized_embeddings_merges(tmp_path):
    """The template added a token the base never had: training resized the embeddings and the
    adapter carries them; the export resizes the base before loading it, as chat does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.run_args import ModelArguments
    from stages.inference.loading import InferenceSpec, load_hf_model, load_tokenizer_and_template
    from stages.loading import resolve_model_path

    folder = make_adapter_output(tmp_path / "resized", seed=4)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool_x|>"]})
    tokenizer.save_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(BASE), dtype=torch.float32)
    old_vocab = base.get_input_embeddings().weight.shape[0]
    assert len(tokenizer) > old_vocab
    base.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    torch.manual_seed(4)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with torch.no_grad():
        model.get_input_embeddings().weight[-8:].normal_()  # the new rows, as training would have learned them
    model.save_pretrained(folder, save_embedding_layers=True)

    out = tmp_path / "resized_merged"
    assert export(tmp_path, "resized", adapter_name_or_path=folder, export_dir=str(out)) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert merged.get_input_embeddings().weight.shape[0] > old_vocab
    spec = InferenceSpec(model=ModelArguments(model_name_or_path=BASE, adapter_name_or_path=[folder]))
    live, _, _ = load_hf_model(spec, load_tokenizer_and_template(spec)[0])
    ids = torch.tensor([[5, 17, 300, tokenizer.convert_tokens_to_ids("<|tool_x|>"), 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, live(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_qlora_adapter_exports_the_dequantized_merge(tmp_path, adapter, exported, capsys):
    """quantization_bit (QLoRA training) does not quantize the export: the base loads in full
    precision, so the result equals the plain merge, and the CLI says so."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "qlora_merged"
    assert export(tmp_path, "qlora", adapter_name_or_path=adapter, export_dir=str(out), quantization_bit=4) == 0
    assert "de-quantized" in capsys.readouterr().out
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    with torch.no_grad():
        qlora = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(qlora, plain, rtol=0, atol=0)
