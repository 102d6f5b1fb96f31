"""What ``bf16: true`` buys on a CPU worker, and what it costs the loss: fp32 against bf16 on the same batches.

    .venv/bin/python benchmarks/cpu_bf16.py                       # every case, every mode
    .venv/bin/python benchmarks/cpu_bf16.py --cases sft-9m --steps 20

Three precisions, each on the same model, batches and seed, through the Trainer as a worker runs it:
- fp32: float32 weights and arithmetic;
- autocast: float32 weights (and optimizer), matmuls under torch.autocast("cpu", bfloat16): the
  Trainer's ``bf16=True`` with the weights left in float32 (what RayFactory does on a CPU worker);
- bf16-weights: weights stored in bfloat16 as well (what ``bf16: true`` loads on a GPU), so the
  optimizer updates bfloat16 numbers.
Per case and mode: the median step time (steps 3 on), and the loss curve's largest and final
(mean of the last 5 steps) difference from fp32's, relative to fp32's loss. In process, without
Ray: the arithmetic alone. The CPU's bf16 support (avx512_bf16 / amx_bf16) is printed first.
Cases: sft-9m (an 8.4M Llama, hidden 256, 8 layers, full fine-tuning, reversal rows of 40-200
tokens, batch 8), dpo-9m (the same model and rows as pairs, sigmoid, a separate reference) and
smollm2-lora-dpo (SmolLM2-135M-Instruct, LoRA r8, the demo model: a 49k vocabulary).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from registries.tokenize import IGNORE_INDEX  # noqa: E402

MODES = ("fp32", "autocast", "bf16-weights")
CASES = ("sft-9m", "dpo-9m", "smollm2-lora-dpo")


class StepTimes(TrainerCallback):
    def __init__(self):
        self.marks, self.losses = [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def reversal_rows(count: int, vocab: int, seed: int = 0) -> list[dict]:
    """Prompt: 20-100 random tokens; answer: them reversed (40-200 tokens a row)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        n = int(torch.randint(20, 101, (1,), generator=gen))
        prompt = torch.randint(10, vocab, (n,), generator=gen).tolist()
        answer = prompt[::-1]
        wrong = answer.copy()
        for i in torch.randint(0, n, (max(1, n // 5),), generator=gen).tolist():
            wrong[i] = int(torch.randint(10, vocab, (1,), generator=gen))
        rows.append({"prompt": prompt, "answer": answer, "wrong": wrong})
    return rows


def sft_row(r):
    ids = r["prompt"] + r["answer"]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [IGNORE_INDEX] * len(r["prompt"]) + r["answer"]}


def pair_row(r):
    row = {}
    for side, answer in (("chosen", r["answer"]), ("rejected", r["wrong"])):
        ids = r["prompt"] + answer
        row.update({f"{side}_input_ids": ids, f"{side}_attention_mask": [1] * len(ids),
                    f"{side}_labels": [IGNORE_INDEX] * len(r["prompt"]) + answer})
    return row


def build_model(case: str, work: str):
    from registries.models import build_tiny_model
    from transformers import AutoModelForCausalLM

    if case.startswith("smollm2"):
        from stages.loading import resolve_model_path

        return resolve_model_path("demo:smollm2-135m-instruct")
    path = os.path.join(work, "model")
    if not os.path.isdir(path):
        build_tiny_model("llama", path, hidden_size=256, num_layers=8, num_heads=4, intermediate_size=1024)
    AutoModelForCausalLM.from_pretrained(path)  # fail early
    return path


def run(case: str, mode: str, steps: int, work: str) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from stages.recipes.dpo import PreferenceTrainer
    from stages.training.reference import Reference, disable_dropout
    from stages.run_args import FinetuningArguments
    from stages.training.collators import PaddingCollator
    from stages.training.preference_collators import PairwiseCollator

    torch.manual_seed(0)
    path = build_model(case, work)
    dtype = torch.bfloat16 if mode == "bf16-weights" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    vocab = model.config.vocab_size
    lora = "lora" in case
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    disable_dropout(model)
    rows = reversal_rows(8 * steps, min(vocab, 4000))
    args = TrainingArguments(output_dir=os.path.join(work, f"out-{case}-{mode}"), use_cpu=True, bf16=mode != "fp32",
                             per_device_train_batch_size=8 if case.startswith("sft") else 4, max_steps=steps,
                             learning_rate=5e-4 if lora else 1e-4, logging_steps=1, save_strategy="no", report_to=[],
                             remove_unused_columns=False, disable_tqdm=True, seed=0, data_seed=0, lr_scheduler_type="constant")
    timer = StepTimes()
    if case.startswith("sft"):
        data = datasets.Dataset.from_list([sft_row(r) for r in rows])
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=PaddingCollator(pad_token_id=0),
                          callbacks=[timer])
    else:
        reference = Reference("adapter_disabled") if lora else Reference(
            "model", AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval().requires_grad_(False))
        tuning = FinetuningArguments(stage="dpo", finetuning_type="lora" if lora else "full",
                                     precompute_ref_log_probs=False)
        data = datasets.Dataset.from_list([pair_row(r) for r in rows])
        trainer = PreferenceTrainer(model=model, args=args, train_dataset=data, data_collator=PairwiseCollator(pad_token_id=0),
                                    callbacks=[timer], reference=reference, finetuning_args=tuning)
    trainer.remove_callback(PrinterCallback)  # the table is the output
    trainer.train()
    times = [b - a for a, b in zip(timer.marks, timer.marks[1:])][2:]
    return {"step_s": statistics.median(times), "losses": timer.losses}


def cpu_bf16_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    found = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return ", ".join(found) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=25)
    opts = parser.parse_args()
    print(f"CPU bf16 support: {cpu_bf16_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"| case | mode | s/step | speed vs fp32 | largest loss diff (rel.) | final loss diff (rel.) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for case in opts.cases:
            base = None
            for mode in opts.modes:
                out = run(case, mode, opts.steps, work)
                if mode == "fp32":
                    base = out
                if base is None:
                    print(f"| {case} | {mode} | {out['step_s']:.3f} | - | - | - |", flush=True)
                    continue
                rel = [abs(a - b) / abs(b) for a, b in zip(out["losses"], base["losses"])]
                final = abs(statistics.mean(out["losses"][-5:]) - statistics.mean(base["losses"][-5:]))
                final /= abs(statistics.mean(base["losses"][-5:]))
                print(f"| {case} | {mode} | {out['step_s']:.3f} | {base['step_s'] / out['step_s']:.2f}x | "
                      f"{max(rel):.2%} | {final:.2%} |", flush=True)
            print(f"fp32 losses {case}: first {base['losses'][0]:.4f}, last {base['losses'][-1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
