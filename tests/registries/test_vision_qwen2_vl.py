"""Qwen2-VL vision plugin: placeholder expansion and image tensors equal LLaMA-Factory 0.9.5's
Qwen2VLPlugin for the same images and the same (real, offline) Qwen2-VL image processor."""


import pytest
import torch
from PIL import Image, ImageDraw

from registries.errors import UserError
from registries.multimodal import VISION_PLUGINS, VisionPlugin, get_vision_plugin, load_image, register_vision_plugin
from registries.multimodal.qwen2_vl import preprocess
from tests.llamafactory import run_in_llamafactory



def image_processor():
    # The PIL backend explicitly: both venvs lack torchvision, and naming it keeps the two identical.
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil()


def draw(path, size, colour, mode="RGB"):
    image = Image.new(mode, size, "white" if mode == "RGB" else 255)
    ImageDraw.Draw(image).ellipse([2, 2, size[0] - 3, size[1] - 3], fill=colour if mode == "RGB" else 0)
    image.save(path)
    return str(path)


@pytest.fixture
def pictures(tmp_path):
    # Sizes chosen to hit every resize rule: plain, above max_pixels, below min_pixels, a side < 28, grey.
    return [
        draw(tmp_path / "a.png", (64, 48), "red"),
        draw(tmp_path / "b.png", (300, 200), "blue"),
        draw(tmp_path / "c.png", (20, 20), "green"),
        draw(tmp_path / "d.png", (100, 10), "black"),
        draw(tmp_path / "e.png", (56, 56), None, mode="L"),
    ]


MAX_PIXELS, MIN_PIXELS = 128 * 128, 32 * 32

LF_SCRIPT = r"""
import json, sys
from llamafactory.data.mm_plugin import get_mm_plugin
from transformers import Qwen2VLImageProcessorPil
args = json.loads(sys.argv[1])

class Processor:  # the attributes LLaMA-Factory's plugin reads from a processor
    image_processor = Qwen2VLImageProcessorPil()
    image_max_pixels = args["max"]
    image_min_pixels = args["min"]

plugin = get_mm_plugin(name="qwen2_vl", image_token="<|image_pad|>", video_token="<|video_pad|>")
messages = plugin.process_messages(args["messages"], args["images"], [], [], Processor())
mm = plugin._get_mm_inputs(args["images"], [], [], Processor())
print(json.dumps({"messages": messages, "grid": mm["image_grid_thw"].tolist(),
                  "pixels": mm["pixel_values"].tolist()}))
"""


def lf_reference(messages, images):
    return run_in_llamafactory(LF_SCRIPT, {"messages": messages, "images": images, "max": MAX_PIXELS, "min": MIN_PIXELS})


def ours(messages, images):
    plugin, processor = get_vision_plugin("qwen2_vl"), image_processor()
    mm = plugin.inputs([load_image(p) for p in images], processor, MAX_PIXELS, MIN_PIXELS)
    return plugin.expand(messages, mm, processor), mm


def test_resize_rules_give_exact_sizes(pictures):
    sizes = [preprocess(load_image(p), MAX_PIXELS, MIN_PIXELS).size for p in pictures]
    # 300x200 -> sqrt(16384/60000) = 0.5226 -> (156, 104); 20x20 -> grown to 32x32; 100x10 -> 101x10 -> side 28.
    assert sizes == [(64, 48), (156, 104), (32, 32), (101, 28), (56, 56)]


def test_token_counts_and_tensors_match_llamafactory(pictures):
    messages = [
        {"role": "user", "content": "<image><image>Which is red?"},
        {"role": "assistant", "content": "The first."},
        {"role": "user", "content": "And these? <image> <image><image>"},
        {"role": "assistant", "content": "green, black, grey"},
    ]
    expanded, mm = ours(messages, pictures)
    reference = lf_reference(messages, pictures)
    assert expanded == reference["messages"]
    assert mm["image_grid_thw"].tolist() == reference["grid"]
    assert torch.equal(mm["pixel_values"], torch.tensor(reference["pixels"], dtype=mm["pixel_values"].dtype))
    # The counts themselves, pinned: grid (1, h/14, w/14) after the processor's smart resize (which
    # also lifts 32x32 to its own 56x56 minimum), merged 2x2: 4, 24, 4, 4, 4 image tokens.
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 12], [1, 4, 4], [1, 2, 8], [1, 4, 4]]
    assert tuple(mm["pixel_values"].shape) == (160, 1176)  # 160 patches of 3*2*14*14 values
    first = expanded[0]["content"]
    assert first == ("<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>") + (
        "<|vision_start|>" + "<|image_pad|>" * 24 + "<|vision_end|>"
    ) + "Which is red?"


def test_placeholder_mismatch_is_a_user_error(pictures):
    with pytest.raises(UserError, match=r"1 <image> placeholder\(s\) but 2 image\(s\)"):
        ours([{"role": "user", "content": "<image>?"}], pictures[:2])


def test_duplicate_plugin_rejected():
    with pytest.raises(ValueError, match="Vision plugin 'qwen2_vl' is already registered"):
        register_vision_plugin(VisionPlugin("qwen2_vl", "x", inputs=dict, expand=list))
    assert "qwen2_vl" in VISION_PLUGINS


def test_unknown_plugin_named():
    with pytest.raises(UserError, match=r"No vision plugin named 'nope'; the registered ones are: .*qwen2_vl"):
        get_vision_plugin("nope")


def test_templates_carry_their_vision_plugin():
    from registries.multimodal import vision_plugin_of
    from registries.templates import get_template

    assert vision_plugin_of(get_template("qwen2_vl")).name == "qwen2_vl"
    assert vision_plugin_of(get_template("llava")).name == "llava"
    assert get_template("qwen2_vl").default_system == "You are a helpful assistant."
    with pytest.raises(UserError, match=r"Template 'qwen' has no vision plugin, so it cannot read images"):
        vision_plugin_of(get_template("qwen"))
