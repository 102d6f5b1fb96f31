"""One training step of a ~8M Llama in one process, by batch layout: padded, padded with gradient
checkpointing (LLaMA-Factory's default), padding-free in rows (eager's), padding-free in one row
with transformers' block-diagonal mask, and in one row attended per example (ours on sdpa).

    .venv/bin/python benchmarks/batch_layouts.py [--threads 2] [--steps 10]

The model of vs_llamafactory.py's 9m-full case (hidden 256, 8 layers, random init), batches of 8
random examples of 50-210 tokens, loss on the second half of each: forward + backward + AdamW,
milliseconds a step (the first two steps not counted). What the layout alone costs, without Ray,
the Trainer or data loading around it.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

from harness import machine_line  # noqa: F401 (sets up the import path)


def bench_model(threads: int):
    """The 9m-full case's model (hidden 256, 8 layers, random init) in training mode, with AdamW;
    torch set to ``threads`` intra-op threads."""
    import torch
    from transformers import AutoModelForCausalLM

    from registries.models import build_tiny_model

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as work:
        path = build_tiny_model("llama", work, hidden_size=256, num_layers=8, num_heads=4, intermediate_size=1024)
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")
    model.config.use_cache = False  # as the Trainer sets it
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def random_batches(vocab: int, steps: int, seed: int = 0) -> list[list[dict]]:
    """``steps`` batches of 8 examples of 50-210 random tokens, the loss on the second half of each."""
    rng = random.Random(seed)

    def example():
        length = rng.randint(50, 210)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        return {"input_ids": ids, "attention_mask": [1] * length, "labels": [-100] * (length // 2) + ids[length // 2:]}

    return [[example() for _ in range(8)] for _ in range(steps)]


def timed_step(model, optimizer, batch) -> float:
    """Seconds for one forward + backward + optimizer step on a collated batch."""
    start = time.perf_counter()
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def time_steps(model, optimizer, collator, batches) -> tuple[float, float]:
    """Forward + backward + optimizer step over ``batches``: (tokens a step, mean ms a step with
    the first two steps not counted)."""
    times, tokens = [], 0
    for features in batches:
        batch = collator(features)
        tokens += batch["input_ids"].numel()
        times.append(timed_step(model, optimizer, batch))
    return tokens / len(batches), 1000 * sum(times[2:]) / len(times[2:])


def main() -> int:
    from stages.training.collators import PaddingCollator, PaddingFreeCollator
    from stages.training.per_example_attention import PER_EXAMPLE_SDPA, use_attention

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model, optimizer = bench_model(args.threads)
    batches = random_batches(model.config.vocab_size, args.steps)
    one_row_per_example = PaddingFreeCollator(pad_token_id=0, one_row=True, attention=PER_EXAMPLE_SDPA)
    layouts = [
        ("padded", PaddingCollator(pad_token_id=0), False),
        ("padded + gradient checkpointing", PaddingCollator(pad_token_id=0), True),
        ("padding-free, rows as wide as the longest example", PaddingFreeCollator(pad_token_id=0), False),
        ("padding-free, one row", PaddingFreeCollator(pad_token_id=0, one_row=True), False),
        ("padding-free, one row attended per example (ours)", one_row_per_example, False),
    ]
    print(machine_line())
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.threads} threads")
    print("| layout | tokens a step (pads included) | ms a step |\n|---|---|---|")
    for name, collator, checkpointing in layouts:
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        use_attention(model, getattr(collator, "attention", None) or "sdpa")
        tokens, ms = time_steps(model, optimizer, collator, batches)
        print(f"| {name} | {tokens:.0f} | {ms:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
