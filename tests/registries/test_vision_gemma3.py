"""Gemma 3 vision plugin: each <image> becomes the processor's full image sequence (newlines,
<start_of_image>, image_seq_length soft tokens, <end_of_image>); expansion and pixel tensors equal
LLaMA-Factory 0.9.5's Gemma3Plugin with the same (PIL) Gemma 3 image processor."""


import pytest
import torch

from registries.errors import UserError
from registries.multimodal import get_vision_plugin, load_image
from registries.templates import get_template
from tests.llamafactory import run_in_llamafactory
from tests.registries.test_vision_qwen2_vl import draw

LF_SCRIPT = r"""
import json, sys
from llamafactory.data.mm_plugin import get_mm_plugin
from transformers import Gemma3ImageProcessorPil
args = json.loads(sys.argv[1])
side, seqlen = args["side"], args["seqlen"]

class Processor:  # the Gemma3Processor attributes LLaMA-Factory's plugin reads
    image_processor = Gemma3ImageProcessorPil(size={"height": side, "width": side})
    boi_token, image_token_id = "<start_of_image>", 7
    full_image_sequence = "\n\n<start_of_image>" + "<image_soft_token>" * seqlen + "<end_of_image>\n\n"

plugin = get_mm_plugin(name="gemma3", image_token="<image_soft_token>")
messages = plugin.process_messages(args["messages"], args["images"], [], [], Processor())
mm = plugin.get_mm_inputs(args["images"], [], [], [len(args["images"])], [0], [0], [args["ids"]], Processor())
print(json.dumps({"messages": messages, "pixels": mm["pixel_values"].tolist(), "types": mm["token_type_ids"]}))
"""

MESSAGES = [
    {"role": "user", "content": "<image>What shape?"},
    {"role": "assistant", "content": "circle"},
    {"role": "user", "content": "And <image>?"},
    {"role": "assistant", "content": "circle"},
]


def gemma3_processor(side, seqlen):
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": side, "width": side}, image_seq_length=seqlen)


@pytest.mark.parametrize("side, seqlen", [(56, 4), (112, 16)])
def test_full_image_sequence_and_pixels_match_llamafactory(tmp_path, side, seqlen):
    images = [draw(tmp_path / "a.png", (64, 48), "red"), draw(tmp_path / "b.png", (900, 700), "blue")]
    plugin = get_vision_plugin("gemma3")
    processor = gemma3_processor(side, seqlen)
    mm = plugin.inputs([load_image(p) for p in images], processor)
    expanded = plugin.expand(MESSAGES, mm, processor)
    ids = [2, 7, 7, 5, 7, 9]
    reference = run_in_llamafactory(
        LF_SCRIPT, {"messages": MESSAGES, "images": images, "side": side, "seqlen": seqlen, "ids": ids}
    )
    assert expanded == reference["messages"]
    assert torch.equal(mm["pixel_values"], torch.tensor(reference["pixels"], dtype=mm["pixel_values"].dtype))
    assert tuple(mm["pixel_values"].shape) == (2, 3, side, side)
    sequence = "\n\n<start_of_image>" + "<image_soft_token>" * seqlen + "<end_of_image>\n\n"
    assert expanded[0]["content"] == sequence + "What shape?"
    assert expanded[2]["content"] == "And " + sequence + "?"
    # LLaMA-Factory's token_type_ids: 1 exactly on the image (soft) token ids.
    assert reference["types"] == [[0, 1, 1, 0, 1, 0]]


def test_gemma3_template_names_the_plugin_and_counts_images(tmp_path):
    assert get_template("gemma3").mm_plugin == "gemma3"
    image = load_image(draw(tmp_path / "a.png", (40, 40), "red"))
    plugin = get_vision_plugin("gemma3")
    mm = plugin.inputs([image, image], gemma3_processor(56, 4))
    with pytest.raises(UserError, match=r"1 <image> placeholder\(s\) but 2 image\(s\)"):
        plugin.expand([{"role": "user", "content": "<image>?"}], mm, gemma3_processor(56, 4))
