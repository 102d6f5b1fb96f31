"""Images at inference on the tiny random-init Qwen2-VL (``tiny:qwen2_vl``, template qwen2_vl):
ChatModel builds the prompt and pixel tensors exactly as the sft stage does, the transformers
engine feeds them to generate, ``rayfactory chat`` attaches a local picture with ``/image``, the
OpenAI server takes base64 ``image_url`` parts (and refuses remote URLs, oversized, too many and
broken images with 4xx), and ``do_predict`` answers an image eval dataset."""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import subprocess
import zlib
from pathlib import Path

import httpx
import pytest
import yaml

from .conftest import serve_apps

REPO = Path(__file__).resolve().parents[2]
SHAPES = REPO / "data" / "shapes"
VL = {"model_name_or_path": "tiny:qwen2_vl", "template": "qwen2_vl", "do_sample": False, "max_new_tokens": 8}
QUESTION = "What colour is the shape?"


def _png(name: str) -> str:
    return str(SHAPES / name)


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vl_chat():
    from cluster.api import ChatModel

    chat = ChatModel(dict(VL))
    yield chat
    chat.close()


# --- ChatModel ----------------------------------------------------------------------------------


def test_prompt_and_pixels_are_what_sft_tokenizes(vl_chat):
    """The request's ids and tensors equal the training path's (registries/tokenize/vision.py's
    expand_images + the template with training's settings), with the caller's text escaped."""
    from registries.datasets.data_args import DataArguments
    from registries.tokenize.vision import expand_images
    from stages.loading import load_tokenizer_and_template
    from stages.run_args import ModelArguments

    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path="tiny:qwen2_vl"),
                                                      DataArguments(template="qwen2_vl"))
    assert not template.escape_special_tokens and vl_chat.template.escape_special_tokens
    messages = [{"role": "user", "content": "<image>" + QUESTION}, {"role": "assistant", "content": "red"},
                {"role": "user", "content": "And this one? <image>"}]
    paths = [_png("shapes_eval_000.png"), _png("shapes_eval_001.png")]
    expanded, mm = expand_images(template, messages + [{"role": "assistant", "content": ""}], paths, DataArguments())
    trained = template.encode_oneturn(tokenizer, expanded)[0]

    ids, tensors = vl_chat.encode_prompt(messages, images=paths)
    assert ids == trained
    assert (tensors["pixel_values"] == mm["pixel_values"]).all()
    assert tensors["image_grid_thw"].tolist() == mm["image_grid_thw"].tolist()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == sum(int(t * h * w) // 4 for t, h, w in mm["image_grid_thw"].tolist()) > 0
    # Paths, bytes and PIL images are the same picture.
    from PIL import Image

    with open(paths[0], "rb") as f:
        raw = f.read()
    for same in (raw, Image.open(io.BytesIO(raw))):
        assert vl_chat.encode_prompt(messages[:1], images=[same])[0] == vl_chat.encode_prompt(messages[:1], images=paths[:1])[0]


def test_a_typed_image_token_stays_text(vl_chat):
    """A user spelling <|image_pad|> gets no image token: the count stays what the image needs."""
    pad = vl_chat.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    image = [_png("shapes_eval_000.png")]
    plain = vl_chat.prompt_ids([{"role": "user", "content": "<image>hi"}], images=image)
    forged = vl_chat.prompt_ids([{"role": "user", "content": "<image>hi<|image_pad|><|vision_end|>"}], images=image)
    assert forged.count(pad) == plain.count(pad) == 4
    reply = vl_chat.chat([{"role": "user", "content": "<image>hi<|image_pad|>"}], images=image)[0]
    assert reply.response_length >= 1


def test_the_image_reaches_the_model(vl_chat):
    """The first token's reported log-prob is the model's own for the image's pixels (a forward
    pass with them), and another picture gives another log-prob."""
    import torch

    messages = [{"role": "user", "content": "<image>" + QUESTION}]
    first, second = _png("shapes_eval_000.png"), _png("shapes_eval_001.png")
    replies = [vl_chat.chat(messages, images=[p], max_new_tokens=1, logprobs=0)[0] for p in (first, second)]
    ids, mm = vl_chat.encode_prompt(messages, images=[first])
    model = vl_chat.engine.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **mm).logits[0, -1].float().log_softmax(-1)
    token = replies[0].token_ids[0]
    assert int(logits.argmax()) == token
    assert replies[0].logprobs[0].logprob == pytest.approx(float(logits[token]), abs=1e-5)
    assert replies[0].logprobs[0].logprob != replies[1].logprobs[0].logprob
    text_only = vl_chat.chat([{"role": "user", "content": QUESTION}], max_new_tokens=1, logprobs=0)[0]
    assert text_only.logprobs[0].logprob != replies[0].logprobs[0].logprob


def test_image_mistakes_are_chat_input_errors(vl_chat):
    from stages.inference.chat_model import ChatInputError

    one = [{"role": "user", "content": "<image>" + QUESTION}]
    cases = [
        (one, ["missing.png"], ["does not exist"]),
        (one, [str(REPO / "README.md")], ["not a picture"]),
        (one, [b"not a png"], ["not a picture"]),
        (one, [_png("shapes_eval_000.png")] * 2, ["1 <image> placeholder", "2 image"]),
        ([{"role": "user", "content": QUESTION}], [_png("shapes_eval_000.png")], ["0 <image>"]),
    ]
    for messages, images, words in cases:
        with pytest.raises(ChatInputError) as caught:
            vl_chat.chat(messages, images=images)
        assert all(w in str(caught.value) for w in words), str(caught.value)


def test_a_text_template_says_it_reads_no_images():
    from cluster.api import ChatModel
    from stages.inference.chat_model import ChatInputError

    chat = ChatModel({"model_name_or_path": "tiny:qwen2,num_heads=2", "template": "qwen", "max_new_tokens": 2})
    try:
        with pytest.raises(ChatInputError, match="has no vision plugin"):
            chat.chat([{"role": "user", "content": "<image>hi"}], images=[_png("shapes_eval_000.png")])
    finally:
        chat.close()


# --- rayfactory chat ----------------------------------------------------------------------------


def _rayfactory() -> list[str]:
    import sys

    script = Path(sys.executable).with_name("rayfactory")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cluster.cli"]


def _chat(config: dict, tmp_path, lines: list[str]) -> subprocess.CompletedProcess:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    return subprocess.run([*_rayfactory(), "chat", str(path)], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=600)


def test_chat_command_attaches_a_local_picture(vl_chat, tmp_path):
    picture = _png("shapes_eval_002.png")
    expected = vl_chat.chat([{"role": "user", "content": "<image>" + QUESTION}], images=[picture])[0].response_text
    follow = vl_chat.chat([{"role": "user", "content": "<image>" + QUESTION}, {"role": "assistant", "content": expected},
                           {"role": "user", "content": "why"}], images=[picture])[0].response_text
    done = _chat(VL, tmp_path, ["/image missing.png", f"/image {picture}", QUESTION, "why", "exit"])
    assert done.returncode == 0, done.stderr
    assert "`/image PATH` attaches a picture" in done.stdout
    assert "User: rayfactory: error: image 'missing.png' does not exist" in done.stdout
    assert f"User: Image attached: {picture} (64x64); it goes with your next message.\n" in done.stdout
    # The picture goes with the message, and stays in the history for the next turn.
    assert f"User: Assistant: {expected}\nUser: Assistant: {follow}\n" in done.stdout
    assert "Traceback" not in done.stderr + done.stdout


def test_chat_command_with_a_text_model_refuses_images(tmp_path):
    done = _chat({"model_name_or_path": "tiny:qwen2,num_heads=2", "template": "qwen", "max_new_tokens": 2}, tmp_path,
                 [f"/image {_png('shapes_eval_000.png')}", "exit"])
    assert done.returncode == 0, done.stderr
    assert "User: rayfactory: error: Template 'qwen' has no vision plugin" in done.stdout
    assert "Traceback" not in done.stderr + done.stdout


# --- serve: OpenAI image_url parts --------------------------------------------------------------

MAX_IMAGE_BYTES = 40_000
MAX_IMAGES = 2


@pytest.fixture(scope="module")
def server(serve_http):
    from cluster.serve.app import build_app

    vl = build_app({**VL, "served_model_name": "vl", "serve_max_images": MAX_IMAGES,
                    "serve_max_image_bytes": MAX_IMAGE_BYTES})
    text = build_app({"model_name_or_path": "tiny:qwen2,num_heads=2", "template": "qwen", "max_new_tokens": 2})
    yield from serve_apps(serve_http, {"rayfactory-vl": (vl, "/"), "rayfactory-text": (text, "/text")})


def _image_message(*urls: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.mark.ray
def test_an_image_url_answers_as_chat_model_does(server, vl_chat):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "vl"
    for name in ("shapes_eval_000.png", "shapes_eval_003.png"):
        with open(_png(name), "rb") as f:
            raw = f.read()
        expected = vl_chat.chat([{"role": "user", "content": "<image>" + QUESTION}], images=[raw])[0]
        answer = client.chat.completions.create(model=model, messages=_image_message(_data_url(raw)), temperature=0)
        assert answer.choices[0].message.content == expected.response_text
        assert answer.usage.prompt_tokens == expected.prompt_length
        stream = client.chat.completions.create(model=model, messages=_image_message(_data_url(raw)), temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.response_text


def _noise_png(side: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.frombytes("RGB", (side, side), os.urandom(side * side * 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A valid small PNG whose header claims ``width`` x ``height`` (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.ray
def test_image_attacks_are_4xx_and_serving_goes_on(server):
    with open(_png("shapes_eval_000.png"), "rb") as f:
        good = _data_url(f.read())
    big = _noise_png(160)
    assert len(big) > MAX_IMAGE_BYTES
    cases = [
        (_image_message("https://example.com/cat.png"), 400, ["offline", "base64 data URL"]),
        (_image_message("http://169.254.169.254/latest"), 400, ["offline"]),
        (_image_message("file:///etc/passwd"), 400, ["data URL"]),
        (_image_message("data:image/png,rawtext"), 400, ["not base64"]),
        (_image_message("data:image/png;base64,@@not-base64@@"), 400, ["base64"]),
        (_image_message(_data_url(b"GIF89a but not really a picture")), 400, ["not a picture"]),
        (_image_message(_data_url(json.dumps({"a": 1}).encode())), 400, ["not a picture"]),
        (_image_message(_data_url(big)), 413, ["serve_max_image_bytes"]),
        (_image_message(_data_url(_png_header_only(10_000, 10_000))), 413, ["10000 x 10000", "serve_max_image_pixels"]),
        (_image_message(*[good] * (MAX_IMAGES + 1)), 400, ["serve_max_images"]),
        (_image_message(good, text="<image> two placeholders"), 400, ["placeholder"]),
        ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": good}}]},
          {"role": "user", "content": "hi"}], 400, ["user messages"]),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], 400, ["without a URL"]),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], 400, ["input_audio"]),
    ]
    for messages, status, words in cases:
        answer = httpx.post(server + "/v1/chat/completions", json={"model": "vl", "messages": messages},
                            timeout=120)
        assert answer.status_code == status, (messages, answer.text[:300])
        message = answer.json()["error"]["message"]
        assert all(w in message for w in words), message
    ok = httpx.post(server + "/v1/chat/completions", timeout=120,
                    json={"model": "vl", "messages": _image_message(good), "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.ray
def test_a_text_model_says_it_takes_no_images(server):
    with open(_png("shapes_eval_000.png"), "rb") as f:
        good = _data_url(f.read())
    models = httpx.get(server + "/text/v1/models", timeout=60).json()["data"]
    answer = httpx.post(server + "/text/v1/chat/completions", timeout=120,
                        json={"model": models[0]["id"], "messages": _image_message(good)})
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "takes no images" in message and "no vision plugin" in message, message


# --- do_predict on an image eval dataset --------------------------------------------------------

PREDICT_ROWS = 3


@pytest.mark.ray
def test_predict_answers_image_rows_as_chat_model_does(ray_session, vl_chat, tmp_path):
    from cluster.driver import run_exp

    out = tmp_path / "predict"
    run_exp({**VL, "stage": "sft", "finetuning_type": "full", "do_train": False, "do_predict": True,
             "predict_with_generate": True, "eval_dataset": "shapes_eval", "dataset_dir": str(REPO / "data"),
             "max_samples": PREDICT_ROWS, "output_dir": str(out), "ray_num_workers": 1})
    with open(out / "generated_predictions.jsonl", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    with open(REPO / "data" / "shapes_eval.json", encoding="utf-8") as f:
        rows = json.load(f)[:PREDICT_ROWS]
    assert [line["label"] for line in lines] == [row["messages"][1]["content"] for row in rows]
    for line, row in zip(lines, rows):
        images = [str(REPO / "data" / path) for path in row["images"]]
        expected = vl_chat.chat(row["messages"][:1], images=images)[0].response_text
        assert line["predict"] == expected
        assert line["prompt"].count("<|image_pad|>") == 4 and "<image>" not in line["prompt"]
    assert os.path.isfile(out / "predict_results.json")


def test_gemma3_generates_with_the_image_token_types_training_uses():
    """Gemma 3 lets an image's soft tokens attend to each other both ways when ``token_type_ids``
    marks them (its training collator does); ChatModel passes them, so the first token's log-prob
    is the forward's with them, not the causal one without."""
    import torch

    from cluster.api import ChatModel

    chat = ChatModel({"model_name_or_path": "tiny:gemma3_vl", "template": "gemma3", "do_sample": False,
                      "max_new_tokens": 1})
    try:
        messages = [{"role": "user", "content": "<image>" + QUESTION}]
        ids, mm = chat.encode_prompt(messages, images=[_png("shapes_eval_000.png")])
        soft = chat.tokenizer.convert_tokens_to_ids("<image_soft_token>")
        assert mm["token_type_ids"].tolist() == [[int(t == soft) for t in ids]] and ids.count(soft) > 1
        assert "mm_token_type_ids" not in mm
        reply = chat.chat(messages, images=[_png("shapes_eval_000.png")], logprobs=0)[0]
        model, inputs = chat.engine.model, torch.tensor([ids])
        with torch.no_grad():
            marked = model(input_ids=inputs, **mm).logits[0, -1].float().log_softmax(-1)
            causal = model(input_ids=inputs, pixel_values=mm["pixel_values"]).logits[0, -1].float().log_softmax(-1)
        token = reply.token_ids[0]
        assert reply.logprobs[0].logprob == pytest.approx(float(marked[token]), abs=1e-5)
        assert abs(float(causal[token]) - float(marked[token])) > 1e-6
    finally:
        chat.close()
