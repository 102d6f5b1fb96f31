"""A Ray Train worker's peak memory with and without ``streaming: true``, as the corpus grows.

    .venv/bin/python benchmarks/streaming_memory.py                      # every case, prints a table
    .venv/bin/python benchmarks/streaming_memory.py --cases stream-1x,whole-1x --steps 10

Stage pt (configs/pt_lora.yaml: tiny Qwen2-style model, LoRA, packing into 64-token blocks) on a
synthetic corpus of 1x, 4x and 16x BASE_LINES lines, written as a txt file for each case. Without
streaming every worker receives the whole tokenized corpus (fabric/worker.py), so its memory grows
with the corpus; with streaming each worker pulls its share as it trains (fabric/data/streamed_shard.py)
and only a shuffle buffer's worth of rows is held. Both train the same few steps: the figure is
what holding the data costs, not training. Figures, not asserts.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile

from harness import bench_main, measure_run, timed_config

BASE_LINES = 50_000  # ~1.8 MB of text, ~0.6M tokens
CASES = {f"{mode}-{factor}x": (mode, factor) for mode in ("whole", "stream") for factor in (1, 4, 16)}
COLUMNS = [
    ("case", "case", "{}"), ("corpus lines", "lines", "{:,}"), ("corpus MiB", "corpus_mib", "{:.1f}"),
    ("steps", "steps", "{}"), ("max RSS / worker", "worker_max_rss_mib", "{:.0f} MiB"),
    ("driver max RSS", "driver_max_rss_mib", "{:.0f} MiB"), ("peak PSS (all procs)", "peak_tree_pss_gib", "{:.2f} GiB"),
    ("time to first step", "time_to_first_step_s", "{:.1f} s"), ("total wall", "wall_s", "{:.1f} s"),
]
WORDS = ("zero one two three four five six seven eight nine ten plus minus equals twice half "
         "the sum of and is more less than").split()


def write_corpus(folder: str, lines: int) -> float:
    """A txt corpus of seeded random 'sentences' and its dataset_info.json entry; returns its MiB."""
    rng = random.Random(0)
    path = os.path.join(folder, "corpus.txt")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ".\n")
    with open(os.path.join(folder, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({"corpus": {"file_name": "corpus.txt", "columns": {"prompt": "text"}}}, f)
    return os.path.getsize(path) / 2**20


def run_case(name: str, steps: int, model_path: str | None) -> dict:
    mode, factor = CASES[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as work:
        corpus_mib = write_corpus(work, BASE_LINES * factor)
        config = timed_config("pt_lora.yaml", os.path.join(work, "out"), steps, dataset="corpus")
        config["dataset_dir"] = work
        if mode == "stream":
            config.update(streaming=True, buffer_size=1024)
        figures = measure_run(config)
    return {"lines": BASE_LINES * factor, "corpus_mib": corpus_mib, **figures}


if __name__ == "__main__":
    sys.exit(bench_main(__file__, __doc__, CASES, lambda name: 20, run_case, COLUMNS))
