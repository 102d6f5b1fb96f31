"""The cases of vs_llamafactory.py: each one YAML (LLaMA-Factory's keys only), its data and its model.

sft cases count examples; the preference cases count what both Trainers' train_samples_per_second
counts, one dataset row: a pair (chosen + rejected) for dpo and rm, one tagged answer (with its
mismatched KL answer) for kto. ``UNITS`` names it per case.
"""

from __future__ import annotations

import json
import os
import random

from harness import REPO_ROOT

SFT_CASES = ("tiny-lora", "9m-full", "smollm2-lora")
PREFERENCE_CASES = ("dpo-full", "dpo-simpo", "kto-full", "rm-full", "smollm2-lora-dpo")
CASES = SFT_CASES + PREFERENCE_CASES
DEFAULT_CASES = ("tiny-lora", "9m-full", "dpo-full", "dpo-simpo", "kto-full", "rm-full")
UNITS = {**{name: "examples" for name in SFT_CASES}, **{name: "pairs" for name in PREFERENCE_CASES},
         "kto-full": "answers"}
PAIRS = 256  # the preference cases' pairs (kto: as many tagged answers, one per pair)
# ~12.9M parameters: 8 x (attention 0.31M + MLP 1.23M) + untied embeddings 2 x ~1.1k x 320.
MODEL_13M = dict(hidden_size=320, num_layers=8, num_heads=4, intermediate_size=1280)


def case_config(name: str, work: str) -> dict:
    """The YAML both systems get (LLaMA-Factory's keys only), with its data and model built in ``work``."""
    from registries.models import build_tiny_model
    from registries.models.families import get_model_family

    data_dir = os.path.join(work, "data")
    common = dict(
        stage="sft", do_train=True, dataset_dir=data_dir, per_device_train_batch_size=8, gradient_accumulation_steps=1,
        lr_scheduler_type="cosine", logging_steps=1, save_strategy="no", report_to="none", seed=42, bf16=False,
        plot_loss=False,
    )
    llama = get_model_family("llama").template
    if name == "tiny-lora":
        model = build_tiny_model("llama", os.path.join(work, "model"), hidden_size=64, num_layers=2, num_heads=4)
        write_dataset(data_dir, "bench_short", arithmetic_rows(1024))
        return dict(common, model_name_or_path=str(model), template=llama, finetuning_type="lora", lora_target="all",
                    lora_rank=8, dataset="bench_short", cutoff_len=64, learning_rate=5.0e-3, num_train_epochs=2)
    if name == "9m-full":
        model = build_tiny_model("llama", os.path.join(work, "model"), hidden_size=256, num_layers=8, num_heads=4,
                                 intermediate_size=1024)
        write_dataset(data_dir, "bench_words", word_rows(256, whole_word_tokens(str(model))))
        return dict(common, model_name_or_path=str(model), template=llama, finetuning_type="full",
                    dataset="bench_words", cutoff_len=256, learning_rate=1.0e-4, num_train_epochs=1)
    if name == "smollm2-lora":
        from stages.loading import resolve_model_path

        with open(os.path.join(REPO_ROOT, "data", "identity_demo.json"), encoding="utf-8") as f:
            rows = json.load(f)
        # LLaMA-Factory's alpaca reader indexes row["input"], which our rows leave out when empty.
        write_dataset(data_dir, "identity_demo", [{"input": "", **row} for row in rows])
        return dict(common, model_name_or_path=resolve_model_path("demo:smollm2-135m-instruct"), template="smollm2",
                    finetuning_type="lora", lora_target="all", lora_rank=8, dataset="identity_demo", cutoff_len=256,
                    learning_rate=5.0e-4, max_steps=20)
    if name == "smollm2-lora-dpo":
        from stages.loading import resolve_model_path

        model = resolve_model_path("demo:smollm2-135m-instruct")
        pairs = reversal_pairs(PAIRS, whole_word_tokens(model), min_words=10, max_words=40)
        write_dataset(data_dir, "bench_pairs", pairs, ranking=True)
        return dict(common, model_name_or_path=model, template="smollm2", finetuning_type="lora", lora_target="all",
                    lora_rank=8, stage="dpo", pref_loss="sigmoid", pref_beta=0.1, dataset="bench_pairs",
                    cutoff_len=256, learning_rate=5.0e-5, max_steps=15)
    if name in ("dpo-full", "dpo-simpo", "kto-full", "rm-full"):
        # One model and one set of 256 reversal pairs (42-210 tokens a sequence) for the four.
        model = build_tiny_model("llama", os.path.join(work, "model"), **MODEL_13M)
        pairs = reversal_pairs(PAIRS, whole_word_tokens(str(model)), min_words=20, max_words=80)
        preference = dict(common, model_name_or_path=str(model), template=llama, finetuning_type="full",
                          cutoff_len=256, learning_rate=1.0e-4, num_train_epochs=1, pref_beta=0.1)
        if name == "kto-full":
            write_dataset(data_dir, "bench_feedback", feedback_rows(pairs), kto=True)
            return dict(preference, stage="kto", dataset="bench_feedback")
        write_dataset(data_dir, "bench_pairs", pairs, ranking=True)
        if name == "rm-full":
            return dict(preference, stage="rm", dataset="bench_pairs")
        if name == "dpo-simpo":
            return dict(preference, stage="dpo", dataset="bench_pairs", pref_loss="simpo", simpo_gamma=0.5,
                        pref_ftx=0.0)
        return dict(preference, stage="dpo", dataset="bench_pairs", pref_loss="sigmoid")
    raise ValueError(f"unknown case {name!r}")


def arithmetic_rows(count: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"instruction": f"What is {a} + {b}?", "input": "", "output": str(a + b)})
    return rows


def whole_word_tokens(model_path: str, count: int = 300) -> list[str]:
    """Words the model's tokenizer encodes as one token each (after a space), so a row's length
    in tokens is its length in words: 40-200 words then stay under cutoff_len 256 and vary."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model_path).get_vocab()
    words = sorted(t[1:] for t in vocab if t.startswith("\u0120") and t[1:].isalpha() and len(t) > 3)
    if len(words) < 50:
        raise RuntimeError(f"the tokenizer in {model_path} has only {len(words)} whole-word tokens")
    return words[:count]


def word_rows(count: int, vocabulary: list[str]) -> list[dict]:
    """Rows of 40-200 words: the answer is the instruction's words in reverse order."""
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(20, 100))]
        rows.append({"instruction": "Reverse: " + " ".join(words), "input": "", "output": " ".join(reversed(words))})
    return rows


def reversal_pairs(count: int, vocabulary: list[str], min_words: int, max_words: int) -> list[dict]:
    """Pairs on the reversal task: chosen is the prompt's words reversed, rejected a corrupted
    reversal (up to a third of the words dropped, or as many random words inserted), so the two
    answers' lengths differ, either way. Every prompt is distinct (kto's KL answers rely on it)."""
    rng = random.Random(1)
    rows = []
    for _ in range(count):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(min_words, max_words))]
        chosen = list(reversed(words))
        rejected = list(chosen)
        for _ in range(rng.randint(1, max(1, len(words) // 3))):
            if rng.random() < 0.5 and len(rejected) > 1:
                del rejected[rng.randrange(len(rejected))]
            else:
                rejected.insert(rng.randrange(len(rejected) + 1), rng.choice(vocabulary))
        if rejected == chosen:
            rejected.append(rng.choice(vocabulary))
        rows.append({"instruction": "Reverse: " + " ".join(words), "input": "", "chosen": " ".join(chosen),
                     "rejected": " ".join(rejected)})
    return rows


def feedback_rows(pairs: list[dict]) -> list[dict]:
    """kto rows from the pairs: one answer per prompt, the chosen one tagged true or the rejected
    one tagged false (at random, about half each), so neighbouring rows never share a prompt:
    LLaMA-Factory pairs every row with the previous row's answer for the KL term, RayFactory with
    the nearest earlier row asked a different prompt, the same row here."""
    rng = random.Random(2)
    rows = []
    for pair in pairs:
        desirable = rng.random() < 0.5
        rows.append({"instruction": pair["instruction"], "input": "",
                     "output": pair["chosen"] if desirable else pair["rejected"], "kto_tag": desirable})
    return rows


def write_dataset(data_dir: str, name: str, rows: list[dict], ranking: bool = False, kto: bool = False) -> None:
    """``name``.json (alpaca) and its dataset_info.json entry: plain, ranking (chosen/rejected
    columns, "ranking": true) or kto (a boolean kto_tag column named under "columns")."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f)
    entry: dict = {"file_name": f"{name}.json"}
    if ranking:
        entry.update(ranking=True, columns={"prompt": "instruction", "query": "input", "chosen": "chosen",
                                            "rejected": "rejected"})
    if kto:
        entry["columns"] = {"prompt": "instruction", "query": "input", "response": "output", "kto_tag": "kto_tag"}
    with open(os.path.join(data_dir, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({name: entry}, f)
