"""LLaVA-1.5 vision plugin: a fixed 576 ``<image>`` tokens per 336-pixel image; expansion and
pixel tensors equal LLaMA-Factory 0.9.5's LlavaPlugin with the same CLIP image processor."""


import pytest
import torch

from registries.errors import UserError
from registries.multimodal import get_vision_plugin, load_image
from tests.llamafactory import run_in_llamafactory
from tests.registries.test_vision_qwen2_vl import draw

LF_SCRIPT = r"""
import json, sys
from llamafactory.data.mm_plugin import get_mm_plugin
from transformers import CLIPImageProcessorPil
args = json.loads(sys.argv[1])

class Processor:  # the LlavaProcessor attributes LLaMA-Factory's plugin reads
    crop = args["crop"]
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": crop}, crop_size={"height": crop, "width": crop})
    patch_size, num_additional_image_tokens, vision_feature_select_strategy = 14, 1, "default"

plugin = get_mm_plugin(name="llava", image_token="<image>")
messages = plugin.process_messages(args["messages"], args["images"], [], [], Processor())
mm = plugin._get_mm_inputs(args["images"], [], [], Processor())
print(json.dumps({"messages": messages, "pixels": mm["pixel_values"].tolist()}))
"""


def clip(crop):
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": crop}, crop_size={"height": crop, "width": crop})


def lf_reference(messages, images, crop):
    return run_in_llamafactory(LF_SCRIPT, {"messages": messages, "images": images, "crop": crop})


@pytest.mark.parametrize("crop, seqlen", [(336, 576), (224, 256)])
def test_fixed_token_count_and_pixels_match_llamafactory(tmp_path, crop, seqlen):
    images = [draw(tmp_path / "a.png", (64, 48), "red"), draw(tmp_path / "b.png", (900, 700), "blue")]
    messages = [
        {"role": "user", "content": "<image>What shape?"},
        {"role": "assistant", "content": "circle"},
        {"role": "user", "content": "And <image>?"},
        {"role": "assistant", "content": "circle"},
    ]
    plugin = get_vision_plugin("llava")
    mm = plugin.inputs([load_image(p) for p in images], clip(crop))
    expanded = plugin.expand(messages, mm, clip(crop))
    reference = lf_reference(messages, images, crop)
    assert expanded == reference["messages"]
    assert torch.equal(mm["pixel_values"], torch.tensor(reference["pixels"], dtype=mm["pixel_values"].dtype))
    assert tuple(mm["pixel_values"].shape) == (2, 3, crop, crop)
    assert expanded[0]["content"] == "<image>" * seqlen + "What shape?"
    assert expanded[2]["content"] == "And " + "<image>" * seqlen + "?"


def test_llava_mismatch_is_a_user_error(tmp_path):
    image = load_image(draw(tmp_path / "a.png", (40, 40), "red"))
    plugin = get_vision_plugin("llava")
    mm = plugin.inputs([image, image], clip(224))
    with pytest.raises(UserError, match=r"1 <image> placeholder\(s\) but 2 image\(s\)"):
        plugin.expand([{"role": "user", "content": "<image>?"}], mm, clip(224))
