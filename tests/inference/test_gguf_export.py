"""``export_format: gguf`` and ``export_quantization_bit``: the files load back in independent readers
(transformers' GGUF loader, llama.cpp through llama-cpp-python, transformers + bitsandbytes) and
generate what the merged model generates; each export type writes its tensors in that type (read
back with the gguf package's reader); the Modelfile's template renders as the training template,
in a Python interpreter of the Go subset it uses and in Go's own text/template (``go``: Debian's
golang-go, which the test command installs; ollama_template.go)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
import yaml

from cluster.cli import main
from tests.ci import skip_or_fail_in_ci

from .conftest import BASE, PROMPTS, make_adapter_output

SMOLLM2 = "demo:smollm2-135m-instruct"
NEW_TOKENS = 24


def llama_cpp():
    if importlib.util.find_spec("llama_cpp") is None:
        skip_or_fail_in_ci("llama-cpp-python is not installed (the test extra has it: bash scripts/setup_venv.sh test)")
    import llama_cpp

    return llama_cpp


def export(tmp_path, name: str, **keys) -> str:
    config = tmp_path / f"{name}.yaml"
    out = tmp_path / name
    config.write_text(yaml.safe_dump({"do_sample": False, "export_dir": str(out), **keys}))
    assert main(["export", str(config)]) == 0
    return str(out)


def gguf_path(out: str) -> str:
    with open(os.path.join(out, "rayfactory_export.json"), encoding="utf-8") as f:
        return os.path.join(out, json.load(f)["gguf"]["file"])


def merged_logits(out: str, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# transformers' GGUF reader takes qwen3's head size as 128 whatever attention.key_length says (the
# tiny model's is 16); llama.cpp reads it.
@pytest.mark.parametrize("family,transformers_reads_it", [("qwen2,num_heads=2", True), ("llama", True), ("qwen3", False)])
def test_tiny_gguf_holds_the_merged_models_logits_in_llama_cpp_and_transformers(tmp_path, family, transformers_reads_it):
    """Random-init tiny models: their greedy choices are too close to call, so the check is the
    logits themselves, teacher-forced over a prompt, and the tokenizer in the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export(tmp_path, "f32", model_name_or_path=f"tiny:{family}", template="qwen" if "qwen" in family else "llama3",
                 export_format="gguf", export_gguf_type="f32")
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "Hello there, what is 12 + 7? The answer, in words:"
    ids = tokenizer(text).input_ids
    expected = merged_logits(out, ids)
    cpp = llama_cpp().Llama(gguf_path(out), n_ctx=128, logits_all=True, verbose=False)
    assert cpp.tokenize(text.encode(), add_bos=True, special=False) == ids  # pre-tokenizer and bos as in HF
    cpp.eval(ids)
    assert np.abs(np.array(cpp.scores[: len(ids)]) - expected).max() < 2e-3  # measured ~2e-4 (f16 KV cache)
    if transformers_reads_it:
        back = AutoModelForCausalLM.from_pretrained(out, gguf_file=os.path.basename(gguf_path(out)), dtype=torch.float32)
        with torch.no_grad():
            assert np.abs(back(torch.tensor([ids])).logits[0].numpy() - expected).max() < 1e-5


def test_bf16_export_writes_bf16_tensors_that_llama_cpp_runs(tmp_path):
    """export_gguf_type: bf16 writes every 2-D weight as BF16 (vectors stay F32), each the f32
    export's weight rounded to bfloat16 (read back with the gguf package's GGUFReader), with
    general.file_type MOSTLY_BF16; llama.cpp runs the file."""
    import gguf
    from transformers import AutoTokenizer

    model = dict(model_name_or_path="tiny:qwen2,num_heads=2", template="qwen", export_format="gguf")
    out = export(tmp_path, "bf16", export_gguf_type="bf16", **model)
    assert gguf_path(out).endswith("-bf16.gguf")
    ours = gguf.GGUFReader(gguf_path(out))
    exact = {t.name: t for t in gguf.GGUFReader(gguf_path(export(tmp_path, "f32", export_gguf_type="f32", **model))).tensors}
    field = ours.fields["general.file_type"]
    assert gguf.LlamaFileType(field.parts[field.data[0]][0]) == gguf.LlamaFileType.MOSTLY_BF16
    assert sorted(t.name for t in ours.tensors) == sorted(exact)
    matrices = 0
    for tensor in ours.tensors:
        f32 = exact[tensor.name]
        assert f32.tensor_type == gguf.GGMLQuantizationType.F32
        expected = np.asarray(f32.data)
        if expected.ndim >= 2:  # a matrix: BF16, rounded as torch rounds
            assert tensor.tensor_type == gguf.GGMLQuantizationType.BF16, (tensor.name, tensor.tensor_type.name)
            expected = torch.from_numpy(expected.copy()).to(torch.bfloat16).float().numpy()
            matrices += 1
        else:  # norms and biases stay float32, as in llama.cpp's own converter
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, (tensor.name, tensor.tensor_type.name)
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert values.shape == expected.shape and np.array_equal(values, expected), tensor.name
    assert matrices >= 7  # the embeddings and every layer's attention and MLP weights
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Hello there, what is 12 + 7? The answer, in words:").input_ids
    cpp = llama_cpp().Llama(gguf_path(out), n_ctx=128, logits_all=True, verbose=False)
    cpp.eval(ids)
    # llama.cpp multiplies bf16 weights by bf16-rounded activations: measured 3e-3 from the f32 model
    assert np.abs(np.array(cpp.scores[: len(ids)]) - merged_logits(out, ids)).max() < 1e-2


@pytest.fixture(scope="module")
def smollm2_exports(tmp_path_factory):
    """SmolLM2-135M-Instruct (a real model: its greedy replies are clear choices) as f16 and q8_0."""
    root = tmp_path_factory.mktemp("gguf_smollm2")
    return {kind: export(root, kind, model_name_or_path=SMOLLM2, template="smollm2", export_format="gguf",
                         export_gguf_type=kind) for kind in ("f16", "q8_0")}


def greedy_reference(out: str, messages):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(ids, add_special_tokens=False).input_ids
    with torch.no_grad():
        reply = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    return tokenizer, ids, reply


def greedy_agreement(model, reference_folder: str) -> tuple[int, int]:
    """Greedy tokens equal to the full model's before the first difference, over PROMPTS (after a
    difference the two continue different texts: nothing more to compare)."""
    agree = total = 0
    for messages in PROMPTS:
        _, ids, reply = greedy_reference(reference_folder, messages)
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
        same = next((k for k, (a, b) in enumerate(zip(theirs.tolist(), reply)) if a != b), min(len(reply), len(theirs)))
        agree, total = agree + same, total + len(reply)
    return agree, total


def test_f16_gguf_generates_the_merged_models_greedy_tokens_in_llama_cpp_and_transformers(smollm2_exports):
    from transformers import AutoModelForCausalLM

    out = smollm2_exports["f16"]
    cpp = llama_cpp().Llama(gguf_path(out), n_ctx=512, verbose=False)
    back = AutoModelForCausalLM.from_pretrained(out, gguf_file=os.path.basename(gguf_path(out)), dtype=torch.float32)
    for messages in PROMPTS:
        tokenizer, ids, reply = greedy_reference(out, messages)
        assert cpp.tokenize(tokenizer.decode(ids).encode(), add_bos=False, special=True) == ids
        ours = []
        for token in cpp.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
            ours.append(token)
            if len(ours) == len(reply):
                break
        assert ours == reply, (tokenizer.decode(ours), tokenizer.decode(reply))
        with torch.no_grad():
            theirs = back.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
        assert theirs.tolist() == reply
    assert "<|im_start|>" in cpp.metadata["tokenizer.chat_template"]  # the training template travels in the file


def test_q8_0_gguf_stays_close_to_the_merged_model(smollm2_exports):
    """Read back with transformers (llama-cpp-python 0.3.36 crashes on every Q8_0 model on this CPU,
    one quantized by llama.cpp itself included, so llama.cpp is not the reader here)."""
    from transformers import AutoModelForCausalLM

    out = smollm2_exports["q8_0"]
    assert os.path.getsize(gguf_path(out)) < 0.6 * os.path.getsize(gguf_path(smollm2_exports["f16"]))
    back = AutoModelForCausalLM.from_pretrained(out, gguf_file=os.path.basename(gguf_path(out)), dtype=torch.float32)
    agree, total = greedy_agreement(back, out)
    print(f"q8_0: {agree}/{total} greedy tokens before the first difference")
    assert agree / total >= 0.75, f"{agree}/{total} greedy tokens as the merged model's"


def render_go(template: str, system: str, messages: list[dict]) -> str:
    """The subset of Go's text/template that to_ollama writes, evaluated as Ollama does."""
    tokens = re.split(r"({{.*?}})", template)

    def block(pos: int, scope: dict) -> tuple[str, int, str]:
        out = ""
        while pos < len(tokens):
            token = tokens[pos]
            action = token[2:-2].strip() if token.startswith("{{") else None
            if action is None:
                out, pos = out + token, pos + 1
            elif action in ("end",) or action.startswith("else"):
                return out, pos, action
            elif action == '"{{"':
                out, pos = out + "{{", pos + 1
            elif action in (".System", ".Content"):
                out, pos = out + scope[action[1:]], pos + 1
            elif action == "range .Messages":
                start, text = pos + 1, ""
                for message in messages:
                    body, pos, _ = block(start, {**scope, "Role": message["role"], "Content": message["content"]})
                    text += body
                if not messages:
                    _, pos, _ = block(start, scope)
                out, pos = out + text, pos + 1
            elif action.startswith("if ") or action.startswith("else if "):
                taken, result = False, ""
                while True:
                    condition = action.removeprefix("else ").removeprefix("if ")
                    holds = bool(scope["System"]) if condition == ".System" else \
                        scope["Role"] == re.fullmatch(r'eq \.Role "(\w+)"', condition).group(1)
                    body, pos, action = block(pos + 1, scope)
                    if holds and not taken:
                        taken, result = True, body
                    if action == "end":
                        break
                out, pos = out + result, pos + 1
            else:
                raise AssertionError(f"unexpected action {token}")
        return out, pos, ""

    return block(0, {"System": system})[0]


@pytest.mark.parametrize("name", ["qwen", "llama3", "chatml", "smollm2", "alpaca", "vicuna"])
def test_the_modelfile_template_renders_a_conversation_as_the_training_template(name):
    from registries.templates import get_template
    from registries.templates.ollama import to_ollama
    from stages.loading import load_tokenizer_and_template
    from types import SimpleNamespace

    from registries.datasets.data_args import DataArguments

    tokenizer, template = load_tokenizer_and_template(SimpleNamespace(model_name_or_path="tiny:qwen2"),
                                                      DataArguments(template=name))
    go = to_ollama(template, tokenizer)
    conversation = [{"role": "user", "content": "What is 2+2? {{ not an action }}"},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    ollama = [{"role": "tool" if m["role"] == "observation" else m["role"], "content": m["content"]} for m in conversation]
    for system in ("", "Answer briefly."):
        expected = template.render(tokenizer, conversation, system=system or None)
        assert render_go(go, system or template.default_system, ollama) == expected, name
    with pytest.raises(ValueError, match="folds the system prompt"):
        to_ollama(get_template("gemma"), tokenizer)


GO_RENDERER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ollama_template.go")


@pytest.fixture(scope="module")
def go_render(tmp_path_factory):
    """render(template, cases) -> each case's prompt as Go's text/template renders it (Ollama's own
    template engine), from ollama_template.go built once."""
    go = shutil.which("go") or ("/usr/lib/go/bin/go" if os.path.exists("/usr/lib/go/bin/go") else None)
    if go is None:
        skip_or_fail_in_ci("Go is not installed, so Go's text/template cannot check the Modelfile's template "
                           "(Debian: apt-get install golang-go; scripts/install_system_packages.sh does it and the "
                           "test command runs that)")
    folder = tmp_path_factory.mktemp("go")
    binary = str(folder / "ollama_template")
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}  # the standard library only: no C, no download
    built = subprocess.run([go, "build", "-o", binary, GO_RENDERER], env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr

    def render(template: str, cases: list[dict]) -> list[str]:
        done = subprocess.run([binary], input=json.dumps({"template": template, "cases": cases}), text=True,
                              capture_output=True, timeout=60)
        assert done.returncode == 0, f"Go's text/template refused the template: {done.stderr}\n{template}"
        return json.loads(done.stdout)

    return render


@pytest.mark.parametrize("name", ["qwen", "llama3", "chatml", "smollm2", "alpaca", "vicuna"])
def test_go_text_template_renders_the_modelfiles_template_as_the_training_template(name, go_render):
    """The TEMPLATE of the Modelfile the export writes, run by Go's text/template with Ollama's
    values (a system prompt and the messages): the training template's text, token for token."""
    from registries.templates.ollama import modelfile
    from stages.loading import load_tokenizer_and_template
    from types import SimpleNamespace

    from registries.datasets.data_args import DataArguments

    tokenizer, template = load_tokenizer_and_template(SimpleNamespace(model_name_or_path="tiny:qwen2"),
                                                      DataArguments(template=name))
    text = modelfile("m.gguf", template, tokenizer, ["<|im_end|>"], {"temperature": 0.7})
    go_template = re.fullmatch(r'(?s).*\nTEMPLATE """(.*?)"""\n.*', text).group(1)
    conversations = [
        [{"role": "user", "content": "What is 2+2? {{ not an action }}"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3+3?"}],
        [{"role": "user", "content": "hi"}],
    ]
    cases, expected = [], []
    for conversation in conversations:
        for system in ("", "Answer briefly."):
            cases.append({"system": system or template.default_system or "", "messages": conversation})
            expected.append(template.render(tokenizer, conversation, system=system or None))
    assert go_render(go_template, cases) == expected, name


def test_the_export_writes_a_modelfile_with_the_stop_words(tmp_path):
    adapter = make_adapter_output(tmp_path / "adapter", seed=3)
    out = export(tmp_path, "withfile", model_name_or_path=BASE, adapter_name_or_path=adapter, export_format="gguf")
    text = open(os.path.join(out, "Modelfile"), encoding="utf-8").read()
    assert text.startswith(f"FROM ./{os.path.basename(gguf_path(out))}\n")
    assert 'PARAMETER stop "<|im_end|>"' in text and "{{ range .Messages }}" in text


def test_gguf_refuses_an_architecture_it_cannot_write_before_writing_anything(tmp_path, capsys):
    config = tmp_path / "gemma.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": "tiny:gemma", "template": "gemma",
                                      "export_dir": str(tmp_path / "o"), "export_format": "gguf"}))
    assert main(["export", str(config)]) == 2
    err = capsys.readouterr().err
    assert "writes the architectures llama, mistral, qwen2, qwen3" in err and "'gemma'" in err
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_export_loads_back_quantized_and_answers_like_the_full_model(tmp_path, bits):
    from transformers import AutoModelForCausalLM

    full = export(tmp_path, "full", model_name_or_path=SMOLLM2, template="smollm2")
    out = export(tmp_path, f"q{bits}", model_name_or_path=SMOLLM2, template="smollm2", export_quantization_bit=bits)
    size = lambda folder: sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert size(out) < (0.6 if bits == 8 else 0.5) * size(full)
    back = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    layer = type(back.model.layers[0].mlp.up_proj).__name__
    assert layer == ("Linear8bitLt" if bits == 8 else "Linear4bit")
    agree, total = greedy_agreement(back, full)
    print(f"bitsandbytes {bits}-bit: {agree}/{total} greedy tokens before the first difference")
    # measured here: 13/36 (8-bit: LLM.int8 computes in float16 on CPU) and 17/36 (4-bit); a broken
    # quantization diverges at the first token (0/36)
    assert agree / total >= 0.25, f"{agree}/{total}"
