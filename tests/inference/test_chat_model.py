"""ChatModel over the transformers engine: prompts as training encodes them, replies as plain
``generate`` gives them, streaming, n, log-probs, stop strings and adapters by name."""

from __future__ import annotations

import pytest
import torch

from cluster.api import ChatModel
from cluster.config import ConfigError, load_config
from stages.inference.chat_model import ChatInputError
from stages.engines.types import PromptTooLong

from .conftest import BASE, PROMPTS, TEMPLATE

GREEDY = {"do_sample": False, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def chat(adapter_outputs):
    return ChatModel({"model_name_or_path": BASE, "adapter_name_or_path": adapter_outputs["math"], **GREEDY})


def _plain_generate(model_folder_adapter, prompt_ids, stop_ids, max_new_tokens):
    """What transformers alone produces for the same ids: the reference for the engine."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from stages.loading import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(BASE), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, model_folder_adapter).eval()
    out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stop_ids, pad_token_id=stop_ids[0])
    return out[0, len(prompt_ids):].tolist()


def test_prompt_is_the_training_encoding_and_the_saved_template_is_used(chat):
    assert chat.template.name == TEMPLATE  # read from the adapter's rayfactory_config.yaml; the config names none
    messages = PROMPTS[2]
    expected = chat.template.encode_oneturn(chat.tokenizer, messages + [{"role": "assistant", "content": ""}])[0]
    assert chat.prompt_ids(messages) == expected
    text = chat.tokenizer.decode(expected, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") and "count to five" in text


def test_greedy_reply_equals_plain_transformers_generate(chat, adapter_outputs):
    for messages in PROMPTS:
        reply = chat.chat(messages)[0]
        ids = _plain_generate(adapter_outputs["math"], chat.prompt_ids(messages), list(chat.stop_token_ids), 12)
        assert reply.token_ids == ids
        content = [t for t in reply.token_ids if t not in chat.stop_token_ids]
        assert reply.response_text == chat.tokenizer.decode(content, skip_special_tokens=True)
        assert reply.prompt_length == len(chat.prompt_ids(messages))
        assert reply.response_length == len(reply.token_ids)
        assert reply.finish_reason == ("stop" if reply.token_ids[-1] in chat.stop_token_ids else "length")


def test_stream_pieces_join_to_the_whole_reply(chat):
    for messages in PROMPTS:
        pieces = list(chat.stream_chat(messages))
        assert len(pieces) >= 2
        assert "".join(pieces) == chat.chat(messages)[0].response_text


def test_max_new_tokens_ends_a_reply_with_length(chat):
    reply = chat.chat(PROMPTS[1], max_new_tokens=3)[0]
    assert reply.response_length == 3 and reply.finish_reason == "length"


def test_n_replies_greedy_are_equal_and_seeded_sampling_repeats(chat):
    greedy = chat.chat(PROMPTS[0], n=3)
    assert [r.index for r in greedy] == [0, 1, 2]
    assert len({tuple(r.token_ids) for r in greedy}) == 1
    first = chat.chat(PROMPTS[0], n=2, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, seed=7)
    again = chat.chat(PROMPTS[0], n=2, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, seed=7)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]


def test_logprobs_are_the_models_own_token_log_probabilities(chat):
    messages = PROMPTS[0]
    reply = chat.chat(messages, logprobs=3)[0]
    prompt = chat.prompt_ids(messages)
    model = chat.engine.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + reply.token_ids])).logits[0].float()
    expected = logits[len(prompt) - 1 : -1].log_softmax(-1)
    assert len(reply.logprobs) == len(reply.token_ids)
    for step, (item, token) in enumerate(zip(reply.logprobs, reply.token_ids)):
        assert item.token_id == token
        assert item.logprob == pytest.approx(float(expected[step, token]), abs=1e-4)
        top = torch.topk(expected[step], 3)
        assert [t for t, _ in item.top] == top.indices.tolist()  # greedy: the chosen token is the top one
        assert item.top[0][0] == token


def test_stop_string_cuts_the_reply(chat):
    whole = chat.chat(PROMPTS[1], max_new_tokens=16)[0].response_text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    cut = chat.chat(PROMPTS[1], max_new_tokens=16, stop=[stop])[0]
    assert cut.response_text == whole[: whole.find(stop)]
    assert cut.finish_reason == "stop"
    assert "".join(chat.stream_chat(PROMPTS[1], max_new_tokens=16, stop=[stop])) == cut.response_text


def test_named_adapters_select_per_request(adapter_outputs):
    both = ChatModel({"model_name_or_path": BASE, "template": TEMPLATE, **GREEDY,
                      "lora_modules": {"math": adapter_outputs["math"], "poet": adapter_outputs["poet"]}})
    assert both.adapters == ("math", "poet")
    alone = {name: ChatModel({"model_name_or_path": BASE, "adapter_name_or_path": path, **GREEDY})
             for name, path in adapter_outputs.items()}
    bare = ChatModel({"model_name_or_path": BASE, "template": TEMPLATE, **GREEDY})
    for messages in PROMPTS[:2]:
        replies = {name: both.chat(messages, adapter=name)[0].token_ids for name in ("math", "poet")}
        for name in replies:
            assert replies[name] == alone[name].chat(messages)[0].token_ids
        assert both.chat(messages)[0].token_ids == bare.chat(messages)[0].token_ids  # no adapter: the base
    assert replies["math"] != replies["poet"]


def test_caller_mistakes_are_clear(chat):
    with pytest.raises(ChatInputError, match="unknown adapter 'nope'"):
        chat.chat(PROMPTS[0], adapter="nope")
    with pytest.raises(ChatInputError, match="role"):
        chat.chat([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ChatInputError, match="non-empty list"):
        chat.chat([])
    with pytest.raises(ChatInputError, match="max_new_tokens"):
        chat.chat(PROMPTS[0], max_new_tokens=0)
    with pytest.raises(PromptTooLong, match="context window"):
        chat.chat([{"role": "user", "content": "word " * 5000}])


def test_inference_configs_need_no_output_dir_but_training_still_does():
    cfg = load_config({"model_name_or_path": BASE, "infer_backend": "hf", "vllm_maxlen": 512}, purpose="infer")
    assert cfg.inference.infer_backend == "huggingface" and cfg.inference.vllm_maxlen == 512
    with pytest.raises(ConfigError, match="output_dir is missing"):
        load_config({"model_name_or_path": BASE})
    with pytest.raises(ConfigError, match="vllm_maxlen"):
        load_config({"model_name_or_path": BASE, "vllm_maxlen": 4}, purpose="infer")
