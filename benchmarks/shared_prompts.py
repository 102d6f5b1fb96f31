"""dpo pairs with the prompt attended once against the full sequences, in process.

    .venv/bin/python benchmarks/shared_prompts.py [--reps 15]

One policy forward and backward of 8 pairs in one padding-free row (chunked log-probs), on a
random-init Llama, alternating the two layouts (stages/training/shared_prefix.py: the rejected
answers borrow their prompt's keys from the chosen sequences, or every sequence in full) and
printing the median step of each. Cases: a tiny model (hidden 64, 2 layers), where a step costs
little more than its calls, with short prompts and very short ones; a 12.9M model (hidden 320, 8
layers, as vs_llamafactory.py's preference cases) with prompts as long as the answers and with
prompts a tenth of them. Figures, not asserts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from registries.tokenize import IGNORE_INDEX  # noqa: E402
from stages.training.collators import PaddingFreeCollator  # noqa: E402
from stages.training.per_example_attention import PER_EXAMPLE_SDPA, use_attention  # noqa: E402
from stages.training.preference_collators import PairwiseCollator  # noqa: E402
from stages.training.sequence_logps import sequence_logps  # noqa: E402
from stages.training.shared_prefix import SHARED_PREFIX_SDPA  # noqa: E402

VOCAB = 500
# name: (hidden, layers, prompt tokens [low, high), answer tokens [low, high))
CASES = {
    "tiny, short prompts": (64, 2, (8, 13), (10, 26)),
    "tiny, very short prompts": (64, 2, (3, 6), (20, 40)),
    "12.9M, prompts as long as answers": (320, 8, (20, 60), (20, 60)),
    "12.9M, prompts a tenth of answers": (320, 8, (5, 10), (60, 120)),
}


def pairs(prompt_range, answer_range, count: int = 8) -> list[dict]:
    """Random pairs: one prompt, two answers of random lengths."""
    rng = torch.Generator().manual_seed(1)

    def tokens(bounds):
        return torch.randint(3, VOCAB, (int(torch.randint(*bounds, (1,), generator=rng)),), generator=rng).tolist()

    out = []
    for _ in range(count):
        prompt, row = tokens(prompt_range), {}
        for name in ("chosen", "rejected"):
            answer = tokens(answer_range)
            row[f"{name}_input_ids"] = prompt + answer
            row[f"{name}_labels"] = [IGNORE_INDEX] * len(prompt) + answer
            row[f"{name}_attention_mask"] = [1] * (len(prompt) + len(answer))
        out.append(row)
    return out


def run_case(hidden, layers, prompt_range, answer_range, reps: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=max(hidden // 32, 2),
                                         max_position_embeddings=1024, attn_implementation="sdpa", use_cache=False))
    rows = PaddingFreeCollator(pad_token_id=0, one_row=True, attention=PER_EXAMPLE_SDPA)
    data = pairs(prompt_range, answer_range)
    batches = {share: PairwiseCollator(pad_token_id=0, rows=rows, share_prompts=share)(data) for share in (False, True)}

    def step(share: bool) -> float:
        use_attention(model, SHARED_PREFIX_SDPA if share else PER_EXAMPLE_SDPA)
        start = time.perf_counter()
        logps, _ = sequence_logps(model, batches[share], chunk_tokens=256)
        logps.sum().backward()
        model.zero_grad()
        return time.perf_counter() - start

    for share in (False, True):  # warm-up
        step(share)
    times = {False: [], True: []}
    for _ in range(reps):
        for share in (False, True):
            times[share].append(step(share))
    median = {share: sorted(v)[len(v) // 2] * 1000 for share, v in times.items()}
    return {"tokens": batches[False]["input_ids"].numel(), "shared_tokens": batches[True]["input_ids"].numel(),
            "full_ms": median[False], "shared_ms": median[True]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print("| case | row tokens, full -> shared | step, full | step, shared | shared / full |")
    print("|---|---|---|---|---|")
    for name, (hidden, layers, prompt_range, answer_range) in CASES.items():
        r = run_case(hidden, layers, prompt_range, answer_range, args.reps)
        print(f"| {name} | {r['tokens']} -> {r['shared_tokens']} | {r['full_ms']:.1f} ms | {r['shared_ms']:.1f} ms "
              f"| {r['shared_ms'] / r['full_ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
