"""Every family registered in alpaca_like / chatml_like / deepseek / glm / harmony / llama2_zh / phi /
role_markers renders a fixed conversation exactly, and its token ids decode back to that text.

The expected strings are written out by hand from each family's own chat format (and
LLaMA-Factory's template.py), not computed from our templates. Where trl ships the family's
official Jinja template, our rendering is also compared with it; deliberate differences are
the ones recorded in the template's ``notes``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import trl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from registries.templates import get_template

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"

SYSTEM = "Be brief."
U1, U2 = "What is 2+2?", "And 3+3?"


def conversation(a1: str = "4.", a2: str = "6.") -> list[dict]:
    return [
        {"role": "user", "content": U1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": U2},
        {"role": "assistant", "content": a2},
    ]


# Reasoning families carry a thought in every reply, written with their thought words. Earlier
# replies lose theirs (history), as in the families' own templates; the last one keeps it.
R1_THOUGHT = "<think>\nAdd.\n</think>\n\n"
OSS_ANALYSIS = "<|channel|>analysis<|message|>Add.<|end|><|start|>assistant"
OSS_FINAL = "<|channel|>final<|message|>"
OSS_THOUGHT = OSS_ANALYSIS + OSS_FINAL  # LLaMA-Factory's way of writing a gpt_oss thought

OSS_SYSTEM_BLOCK = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
)


# --------------------------------------------------------------------------- tokenizers
@functools.lru_cache(maxsize=1)
def _base_tokenizer_json() -> str:
    """A small byte-level BPE: any text (CJK, fullwidth bars, emoji) round-trips through it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = [SYSTEM, U1, U2, "4. 6. Add. assistant user system Instruction Response", "你是一个乐于助人的助手"]
    tok.train_from_iterator(corpus * 20, trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=None)
def make_tokenizer(bos: str | None, eos: str, markers: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Shared per family: callers must not mutate it (use ``build_tokenizer`` for that)."""
    return build_tokenizer(bos, eos, markers)


def build_tokenizer(bos: str | None, eos: str, markers: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The family's bos/eos and its marker strings as added special tokens (single ids)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_base_tokenizer_json()),
        bos_token=bos,
        eos_token=eos,
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": list(markers)})
    return tok


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------- the families
@dataclass(frozen=True)
class Case:
    bos: str | None
    eos: str
    markers: tuple[str, ...]
    rendered: str  # system + 2 turns
    replies: tuple[str, str]  # what each turn's response ids decode to
    thought: str = ""  # written in front of each reply for reasoning families

    def tokenizer(self):
        return make_tokenizer(self.bos, self.eos, self.markers)

    def messages(self):
        return conversation(self.thought + "4.", self.thought + "6.")


LLAMA_TOKENS = ("<s>", "</s>")
DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
IM = ("<|im_start|>", "<|im_end|>")
CHATML = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
    "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n6.<|im_end|>\n"
)
CHATML_REPLIES = ("4.<|im_end|>\n", "6.<|im_end|>\n")
PHI3 = (
    "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4.<|end|>\n"
    "<|user|>\nAnd 3+3?<|end|>\n<|assistant|>\n6.<|end|>\n"
)
PHI3_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
GRANITE = (
    "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>What is 2+2?<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
    "4.<|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>And 3+3?<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
    "6.<|end_of_text|>\n"
)
GRANITE_MARKERS = ("<|start_of_role|>", "<|end_of_role|>")
GLM = "<|system|>\nBe brief.<|user|>\nWhat is 2+2?<|assistant|>\n4.<|user|>\nAnd 3+3?<|assistant|>\n6."
GLM_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

CASES: dict[str, Case] = {
    # ---- alpaca_like
    "alpaca": Case(
        *LLAMA_TOKENS,
        (),
        "Be brief.### Instruction:\nWhat is 2+2?\n\n### Response:\n4.</s>\n\n"
        "### Instruction:\nAnd 3+3?\n\n### Response:\n6.</s>\n\n",
        ("4.</s>\n\n", "6.</s>\n\n"),
    ),
    "vicuna": Case(
        *LLAMA_TOKENS,
        (),
        "Be brief.USER: What is 2+2? ASSISTANT:4.</s>USER: And 3+3? ASSISTANT:6.</s>",
        ("4.</s>", "6.</s>"),
    ),
    "solar": Case(
        *LLAMA_TOKENS,
        (),
        "### System:\nBe brief.\n\n### User:\nWhat is 2+2?\n\n### Assistant:\n4.### User:\nAnd 3+3?\n\n### Assistant:\n6.",
        ("4.", "6."),
    ),
    "falcon": Case(
        None,
        "<|endoftext|>",
        (),
        "Be brief.User: What is 2+2?\nFalcon:4.\nUser: And 3+3?\nFalcon:6.\n",
        ("4.\n", "6.\n"),
    ),
    "openchat": Case(
        "<s>",
        "<|end_of_turn|>",
        (),
        "<s>Be brief.GPT4 Correct User: What is 2+2?<|end_of_turn|>GPT4 Correct Assistant:4.<|end_of_turn|>"
        "GPT4 Correct User: And 3+3?<|end_of_turn|>GPT4 Correct Assistant:6.<|end_of_turn|>",
        ("4.<|end_of_turn|>", "6.<|end_of_turn|>"),
    ),
    "baichuan2": Case(
        *LLAMA_TOKENS,
        ("<reserved_106>", "<reserved_107>"),
        "Be brief.<reserved_106>What is 2+2?<reserved_107>4.<reserved_106>And 3+3?<reserved_107>6.",
        ("4.", "6."),
    ),
    "index": Case(
        *LLAMA_TOKENS,
        ("reserved_0", "reserved_1"),
        "<unk>Be brief.reserved_0What is 2+2?reserved_14.reserved_0And 3+3?reserved_16.",
        ("4.", "6."),
    ),
    # ---- chatml_like
    "yi": Case("<|startoftext|>", "<|im_end|>", IM, CHATML, CHATML_REPLIES),
    "smollm": Case("<|im_start|>", "<|im_end|>", IM, CHATML, CHATML_REPLIES),
    "smollm2": Case("<|im_start|>", "<|im_end|>", IM, CHATML, CHATML_REPLIES),
    "intern2": Case("<s>", "</s>", IM, "<s>" + CHATML, CHATML_REPLIES),
    "cpm4": Case("<s>", "</s>", IM, "<s>" + CHATML, CHATML_REPLIES),
    # ---- deepseek
    "deepseek": Case(
        DS_BOS,
        DS_EOS,
        (),
        f"{DS_BOS}Be brief.\n\nUser: What is 2+2?\n\nAssistant: 4.{DS_EOS}User: And 3+3?\n\nAssistant: 6.{DS_EOS}",
        (f" 4.{DS_EOS}", f" 6.{DS_EOS}"),
    ),
    "deepseekcoder": Case(
        DS_BOS,
        "<|EOT|>",
        (),
        f"{DS_BOS}Be brief.### Instruction:\nWhat is 2+2?\n### Response:\n4.\n<|EOT|>\n"
        "### Instruction:\nAnd 3+3?\n### Response:\n6.\n<|EOT|>\n",
        ("\n4.\n<|EOT|>\n", "\n6.\n<|EOT|>\n"),
    ),
    "deepseek3": Case(
        DS_BOS,
        DS_EOS,
        ("<｜User｜>", "<｜Assistant｜>"),
        f"{DS_BOS}Be brief.<｜User｜>What is 2+2?<｜Assistant｜>4.{DS_EOS}<｜User｜>And 3+3?<｜Assistant｜>6.{DS_EOS}",
        (f"4.{DS_EOS}", f"6.{DS_EOS}"),
    ),
    "deepseekr1": Case(
        DS_BOS,
        DS_EOS,
        ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        f"{DS_BOS}Be brief.<｜User｜>What is 2+2?<｜Assistant｜>4.{DS_EOS}"
        f"<｜User｜>And 3+3?<｜Assistant｜><think>\nAdd.\n</think>\n\n6.{DS_EOS}",
        (f"4.{DS_EOS}", f"<think>\nAdd.\n</think>\n\n6.{DS_EOS}"),
        thought=R1_THOUGHT,
    ),
    # ---- glm
    "glm4": Case(None, "<|endoftext|>", GLM_MARKERS + ("[gMASK]", "<sop>"), "[gMASK]<sop>" + GLM, ("\n4.", "\n6.")),
    "chatglm3": Case(None, "</s>", GLM_MARKERS + ("[gMASK]", "sop"), "[gMASK]sop" + GLM, ("\n4.", "\n6.")),
    # ---- harmony
    "gpt_oss": Case(
        None,
        "<|return|>",
        ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|call|>"),
        OSS_SYSTEM_BLOCK + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
        f"<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant{OSS_FINAL}4.<|return|>"
        f"<|start|>user<|message|>And 3+3?<|end|><|start|>assistant{OSS_ANALYSIS}{OSS_FINAL}6.<|return|>",
        (f"{OSS_FINAL}4.<|return|>", f"{OSS_ANALYSIS}{OSS_FINAL}6.<|return|>"),
        thought=OSS_THOUGHT,
    ),
    # ---- llama2_zh
    "llama2_zh": Case(
        *LLAMA_TOKENS,
        (),
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is 2+2? [/INST]4.</s><s>[INST] And 3+3? [/INST]6.</s>",
        ("4.</s>", "6.</s>"),
    ),
    # ---- phi
    "phi": Case("<s>", "<|endoftext|>", PHI3_MARKERS, PHI3, ("4.<|end|>\n", "6.<|end|>\n")),
    "phi_small": Case(
        "<|endoftext|>", "<|endoftext|>", PHI3_MARKERS, "<|endoftext|>" + PHI3, ("4.<|end|>\n", "6.<|end|>\n")
    ),
    "phi4": Case(
        None,
        "<|im_end|>",
        ("<|im_start|>", "<|im_sep|>"),
        "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>What is 2+2?<|im_end|>"
        "<|im_start|>assistant<|im_sep|>4.<|im_end|><|im_start|>user<|im_sep|>And 3+3?<|im_end|>"
        "<|im_start|>assistant<|im_sep|>6.<|im_end|>",
        ("4.<|im_end|>", "6.<|im_end|>"),
    ),
    "phi4_mini": Case(
        None,
        "<|endoftext|>",
        PHI3_MARKERS,
        "<|system|>Be brief.<|end|><|user|>What is 2+2?<|end|><|assistant|>4.<|end|>"
        "<|user|>And 3+3?<|end|><|assistant|>6.<|end|>",
        ("4.<|end|>", "6.<|end|>"),
    ),
    # ---- role_markers
    "cohere": Case(
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        ("<|START_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"),
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is 2+2?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>4.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>And 3+3?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>6.<|END_OF_TURN_TOKEN|>",
        ("4.<|END_OF_TURN_TOKEN|>", "6.<|END_OF_TURN_TOKEN|>"),
    ),
    "granite3": Case(None, "<|end_of_text|>", GRANITE_MARKERS, GRANITE, ("4.<|end_of_text|>\n", "6.<|end_of_text|>\n")),
    "granite4": Case(None, "<|end_of_text|>", GRANITE_MARKERS, GRANITE, ("4.<|end_of_text|>\n", "6.<|end_of_text|>\n")),
    "exaone": Case(
        None,
        "[|endofturn|]",
        ("[|system|]", "[|user|]", "[|assistant|]"),
        "[|system|]Be brief.[|endofturn|]\n[|user|]What is 2+2?\n[|assistant|]4.[|endofturn|]\n"
        "[|user|]And 3+3?\n[|assistant|]6.[|endofturn|]\n",
        ("4.[|endofturn|]\n", "6.[|endofturn|]\n"),
    ),
    "zephyr": Case(
        *LLAMA_TOKENS,
        ("<|system|>", "<|user|>", "<|assistant|>"),
        "<|system|>\nBe brief.</s><|user|>\nWhat is 2+2?</s><|assistant|>\n4.</s>"
        "<|user|>\nAnd 3+3?</s><|assistant|>\n6.</s>",
        ("4.</s>", "6.</s>"),
    ),
    "olmo": Case(
        None,
        "<|endoftext|>",
        ("<|user|>", "<|assistant|>"),
        "<|endoftext|>Be brief.<|user|>\nWhat is 2+2?<|assistant|>\n4.<|endoftext|>"
        "<|user|>\nAnd 3+3?<|assistant|>\n6.<|endoftext|>",
        ("4.<|endoftext|>", "6.<|endoftext|>"),
    ),
    "openchat-3.6": Case(
        "<|begin_of_text|>",
        "<|eot_id|>",
        ("<|start_header_id|>", "<|end_header_id|>"),
        "<|begin_of_text|>Be brief."
        "<|start_header_id|>GPT4 Correct User<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>GPT4 Correct Assistant<|end_header_id|>\n\n4.<|eot_id|>"
        "<|start_header_id|>GPT4 Correct User<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>GPT4 Correct Assistant<|end_header_id|>\n\n6.<|eot_id|>",
        ("4.<|eot_id|>", "6.<|eot_id|>"),
    ),
}

REQUIRED = {
    "alpaca", "vicuna", "zephyr", "cohere", "falcon", "granite3", "olmo", "smollm2", "intern2", "gpt_oss",
    "openchat", "solar", "yi", "glm4", "deepseek", "deepseek3", "deepseekr1", "phi", "phi4",
}  # fmt: skip


def test_every_required_family_is_registered_and_covered():
    assert REQUIRED <= set(CASES)
    for name in CASES:
        assert get_template(name).name == name


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_is_exact(name):
    case = CASES[name]
    assert get_template(name).render(case.tokenizer(), case.messages(), SYSTEM) == case.rendered


@pytest.mark.parametrize("name", sorted(CASES))
def test_ids_decode_to_the_rendering_turn_by_turn(name):
    case, template = CASES[name], get_template(name)
    tok = case.tokenizer()
    pairs = template.encode_multiturn(tok, case.messages(), SYSTEM)
    assert len(pairs) == 2
    assert decode(tok, [i for prompt, response in pairs for i in prompt + response]) == case.rendered
    assert tuple(decode(tok, response) for _, response in pairs) == case.replies
    # the one-turn split is the same ids with everything before the last reply as prompt
    prompt, response = template.encode_oneturn(tok, case.messages(), SYSTEM)
    assert prompt == pairs[0][0] + pairs[0][1] + pairs[1][0] and response == pairs[1][1]


@pytest.mark.parametrize(
    ("name", "marker"),
    [("chatglm3", "[gMASK]"), ("chatglm3", "sop"), ("chatglm3", "<|user|>"), ("deepseek3", "<｜User｜>")],
)
def test_markers_are_single_ids(name, marker):
    case = CASES[name]
    tok = case.tokenizer()
    ids = [i for p, r in get_template(name).encode_multiturn(tok, case.messages(), SYSTEM) for i in p + r]
    assert tok.convert_tokens_to_ids(marker) in ids


def test_chatglm3_named_token_missing_from_vocab_is_a_clear_error():
    tok = make_tokenizer(None, "</s>")  # no GLM role tokens
    with pytest.raises(ValueError, match=r"Token '\[gMASK\]' is not in the tokenizer's vocabulary"):
        get_template("chatglm3").encode_multiturn(tok, conversation(), SYSTEM)


@pytest.mark.parametrize(
    ("name", "default"),
    [
        ("smollm2", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
        ("vicuna", "A chat between a curious user and an artificial intelligence assistant. "
         "The assistant gives helpful, detailed, and polite answers to the user's questions."),
        ("llama2_zh", "You are a helpful assistant. 你是一个乐于助人的助手。"),
        ("granite4", "You are Granite, developed by IBM. You are a helpful AI assistant."),
    ],
)  # fmt: skip
def test_default_system_is_used_when_none_given(name, default):
    case = CASES[name]
    template, tok = get_template(name), case.tokenizer()
    assert template.render(tok, case.messages()) == case.rendered.replace(SYSTEM, default)


def test_no_system_no_system_slot():
    tok = CASES["phi"].tokenizer()
    assert get_template("phi").render(tok, conversation()) == PHI3.replace("<|system|>\nBe brief.<|end|>\n", "")


def test_efficient_eos_families_leave_the_eos_to_the_tokenize_step():
    for name in ("solar", "falcon", "baichuan2", "index", "glm4", "chatglm3"):
        case = CASES[name]
        tok = case.tokenizer()
        ids = [i for p, r in get_template(name).encode_multiturn(tok, case.messages(), SYSTEM) for i in p + r]
        assert get_template(name).efficient_eos and tok.eos_token_id not in ids, name


def test_replace_eos_families_make_their_end_marker_the_eos():
    expected = {"phi": "<|end|>", "phi4": "<|im_end|>", "gpt_oss": "<|return|>"}
    for name, eos in expected.items():
        tok = build_tokenizer("<s>", "</s>", ("<|end|>", "<|im_end|>", "<|return|>", "<|call|>"))
        assert get_template(name).fix_tokenizer(tok) == []  # already in the vocabulary: nothing new
        assert tok.eos_token == eos and tok.eos_token_id == tok.convert_tokens_to_ids(eos), name


# --------------------------------------------------------------------------- reasoning details
def test_deepseekr1_last_reply_without_thought_gets_the_empty_block():
    tok = CASES["deepseekr1"].tokenizer()
    pairs = get_template("deepseekr1").encode_multiturn(tok, conversation(), SYSTEM)
    assert [decode(tok, r) for _, r in pairs] == [f"4.{DS_EOS}", f"<think>\n\n</think>\n\n6.{DS_EOS}"]
    assert decode(tok, pairs[0][0]) == f"{DS_BOS}Be brief.<｜User｜>What is 2+2?<｜Assistant｜>"


@pytest.mark.parametrize("thought", [OSS_THOUGHT, OSS_ANALYSIS], ids=["llamafactory-style", "thought-words"])
def test_gpt_oss_accepts_both_ways_of_writing_a_thought(thought):
    case = CASES["gpt_oss"]
    messages = conversation(thought + "4.", thought + "6.")
    assert get_template("gpt_oss").render(case.tokenizer(), messages, SYSTEM) == case.rendered


def test_gpt_oss_reply_without_thought_is_still_a_final_message():
    case = CASES["gpt_oss"]
    tok = case.tokenizer()
    pairs = get_template("gpt_oss").encode_multiturn(tok, conversation(), SYSTEM)
    empty = "<|channel|>analysis<|message|><|end|><|start|>assistant"
    assert [decode(tok, r) for _, r in pairs] == [f"{OSS_FINAL}4.<|return|>", f"{empty}{OSS_FINAL}6.<|return|>"]


def test_gpt_oss_tool_call_goes_to_the_commentary_channel():
    case = CASES["gpt_oss"]
    messages = [
        {"role": "user", "content": U1},
        {"role": "function", "content": OSS_ANALYSIS + '{"name": "add", "arguments": {"a": 2, "b": 2}}'},
        {"role": "observation", "content": "4"},
        {"role": "assistant", "content": "4."},
    ]
    assert get_template("gpt_oss").render(case.tokenizer(), messages) == (
        OSS_SYSTEM_BLOCK + "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant" + OSS_ANALYSIS
        + '<|channel|>commentary<|message|>Action: add\nAction Input: {"a": 2, "b": 2}<|call|>'
        + "<|start|>user<|message|>4<|end|><|start|>assistant"
        + "<|channel|>analysis<|message|><|end|><|start|>assistant" + OSS_FINAL + "4.<|return|>"
    )


# --------------------------------------------------------------------------- official templates
def official(jinja: str, tok, messages, system=None, generation=False, **kwargs) -> str:
    chat = ([{"role": "system", "content": system}] if system else []) + messages
    source = (TRL_TEMPLATES / jinja).read_text()
    return tok.apply_chat_template(
        chat, chat_template=source, tokenize=False, add_generation_prompt=generation, **kwargs
    )


ONE_TURN = conversation()[:2]
TWO_TURNS = conversation()
SHAPES = [(ONE_TURN, None), (ONE_TURN, SYSTEM), (TWO_TURNS, None), (TWO_TURNS, SYSTEM)]
SHAPE_IDS = ["1turn", "1turn+system", "2turns", "2turns+system"]


@pytest.mark.parametrize("jinja", ["phi3.jinja", "phi3_5.jinja"])
@pytest.mark.parametrize(("messages", "system"), SHAPES, ids=SHAPE_IDS)
def test_phi_matches_official_but_for_the_final_eos(jinja, messages, system):
    tok, template = CASES["phi"].tokenizer(), get_template("phi")
    # documented: the official template closes a training sample with the original eos
    assert official(jinja, tok, messages, system) == template.render(tok, messages, system) + "<|endoftext|>"
    assert official(jinja, tok, messages[:-1], system, generation=True) == template.render(tok, messages[:-1], system)


@pytest.mark.parametrize(("messages", "system"), SHAPES, ids=SHAPE_IDS)
def test_cohere_matches_official(messages, system):
    tok, template = CASES["cohere"].tokenizer(), get_template("cohere")
    assert official("cohere.jinja", tok, messages, system) == template.render(tok, messages, system)
    assert official("cohere.jinja", tok, messages[:-1], system, True) == template.render(tok, messages[:-1], system)


def test_cohere_keeps_whitespace_the_official_template_strips():
    tok, template = CASES["cohere"].tokenizer(), get_template("cohere")
    padded = [{"role": "user", "content": "  hi \n"}, {"role": "assistant", "content": "\tyo "}]
    ours = template.render(tok, padded)
    assert "<|USER_TOKEN|>  hi \n<|END_OF_TURN_TOKEN|>" in ours and "<|CHATBOT_TOKEN|>\tyo <|END_OF_TURN_TOKEN|>" in ours
    stripped = [{"role": m["role"], "content": m["content"].strip()} for m in padded]
    assert official("cohere.jinja", tok, padded) == template.render(tok, stripped)
    assert "content.strip()" in template.notes


@pytest.mark.parametrize(("messages", "system"), SHAPES, ids=SHAPE_IDS)
def test_deepseek3_matches_official_but_for_the_opened_thought(messages, system):
    tok, template = CASES["deepseek3"].tokenizer(), get_template("deepseek3")
    assert official("deepseekv3.jinja", tok, messages, system) == template.render(tok, messages, system)
    prompt = template.render(tok, messages[:-1], system)
    assert official("deepseekv3.jinja", tok, messages[:-1], system, True) == prompt + "<think>\n"


@pytest.mark.parametrize(("messages", "system"), SHAPES, ids=SHAPE_IDS)
def test_deepseekr1_differs_from_official_only_as_documented(messages, system):
    tok, template = CASES["deepseekr1"].tokenizer(), get_template("deepseekr1")
    ours = template.render(tok, messages, system)
    # a last reply without a thought: we add the empty block, the official does not
    assert official("deepseek_r1_distill.jinja", tok, messages, system) == ours.replace("<think>\n\n</think>\n\n", "")
    # the official generation prompt opens a thought
    prompt = template.render(tok, messages[:-1], system)
    assert official("deepseek_r1_distill.jinja", tok, messages[:-1], system, True) == prompt + "<think>\n"
    assert "'<think>\\n'" in template.notes


def test_deepseekr1_trains_the_last_thought_the_official_template_drops():
    case, template = CASES["deepseekr1"], get_template("deepseekr1")
    tok = case.tokenizer()
    ours = template.render(tok, case.messages(), SYSTEM)
    # the official keeps what follows "</think>" in each reply, blank lines included
    expected = ours.replace("<think>\nAdd.\n</think>", "").replace("<｜Assistant｜>4.", "<｜Assistant｜>\n\n4.")
    assert official("deepseek_r1_distill.jinja", tok, case.messages(), SYSTEM) == expected


def _oss_official_messages(messages: list[dict]) -> list[dict]:
    """Our thought-in-content replies as the official template wants them (a 'thinking' field)."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m["content"].startswith(OSS_THOUGHT):
            out.append({"role": "assistant", "content": m["content"][len(OSS_THOUGHT) :], "thinking": "Add."})
        else:
            out.append(m)
    return out


def _oss_official(tok, messages, system=None, generation=False):
    return official(
        "gptoss.jinja", tok, _oss_official_messages(messages), system, generation, strftime_now=lambda fmt: "2025-08-05"
    )


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
@pytest.mark.parametrize("turns", [1, 2])
def test_gpt_oss_matches_official_but_for_the_history_end_token(system, turns):
    case, template = CASES["gpt_oss"], get_template("gpt_oss")
    tok = case.tokenizer()
    messages = case.messages()[: 2 * turns]
    ours = template.render(tok, messages, system)
    # an earlier reply ends with <|end|> in the official template, <|return|> here
    def official_history(text):  # "4." is an earlier reply only in the 2-turn conversation
        return text.replace(f"{OSS_FINAL}4.<|return|><|start|>user", f"{OSS_FINAL}4.<|end|><|start|>user")

    assert _oss_official(tok, messages, system) == official_history(ours)
    prompt = template.render(tok, messages[:-1], system)
    assert _oss_official(tok, messages[:-1], system, True) == official_history(prompt)
    assert "(official: '<|end|>')" in template.notes


def test_gpt_oss_last_reply_without_thought_differs_from_official_by_the_empty_analysis():
    case, template = CASES["gpt_oss"], get_template("gpt_oss")
    tok = case.tokenizer()
    ours = template.render(tok, conversation()[:2], SYSTEM)
    assert _oss_official(tok, conversation()[:2], SYSTEM) == ours.replace(
        "<|channel|>analysis<|message|><|end|><|start|>assistant", ""
    )
