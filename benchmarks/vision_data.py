"""Image preprocessing at scale: the driver against Ray Data with 1 and 2 workers, rows compared.

    .venv/bin/python benchmarks/vision_data.py                       # 3000 pictures, every case
    .venv/bin/python benchmarks/vision_data.py --count 600 --cases driver,ray_data-2

``write_many`` (registries/synthetic/shapes.py) draws COUNT pictures once, each at one of
MANY_SIZES (32 to 512 pixels a side), two sft rows per picture. Each case then prepares them for
``tiny:qwen2_vl`` sft (template qwen2_vl, cutoff_len 128: no row is dropped) through
``prepare_datasets`` in a child process with its own local Ray, as training would:

* ``driver``: ``preprocessing_engine: driver``: the driver decodes, resizes and tokenizes.
* ``ray_data-<n>``: ``preprocessing_engine: ray_data`` on a local Ray of n CPUs, so at most n
  tokenizing tasks (Ray Data worker processes) run at once.

The images are resized between MIN_PIXELS and MAX_PIXELS: 32 and 48 pixels grow to 56 (4 x 4
patches), 64 stays 56 after Qwen2-VL's rounding, 128..512 shrink to 84 (6 x 6 patches).

The time is ``prepare_datasets``' (Ray's start is not in it; the Ray Data worker processes'
start is). Memory: a thread samples, every SAMPLE_S, the RSS and the USS of every Ray worker
process (``ray::`` in its process title) under the case's local Ray, and keeps each one's peak.
USS (the pages only that process holds) is what one more worker costs: RSS also counts, in
every worker, the shared libraries (torch, Transformers) mapped once in RAM. The figure is the
largest peak among the workers that ran a tokenizing task (its title names ``_tokenize_block``);
the other Ray workers' largest peak USS is the baseline of a worker that holds no rows.
Ray Data's own stats (``Dataset.stats()``) report times and block sizes, not a task's memory.
The driver's peak RSS (up to the end of ``prepare_datasets``) is where the driver case decodes.

Every case also hashes each tokenized row (input_ids, attention_mask, labels, the pixel_values
bytes and image_grid_thw); the parent checks each Ray Data case's rows equal the driver's, row for
row in order, and, if not, whether they are the same rows in another order. Figures, not asserts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness

from harness import bench_main, machine_line  # noqa: E402 (harness puts the repo root on the path)

from registries.synthetic import shapes  # noqa: E402

COUNT = 3000
MIN_PIXELS, MAX_PIXELS = 56 * 56, 84 * 84
CUTOFF_LEN = 128  # the largest image is 9 tokens, a row ~30: nothing is cut or dropped
SAMPLE_S = 0.25
DATA_ENV = "RAYFACTORY_BENCH_VISION_DATA"  # the parent's generated dataset_dir, for the children
CASES = {"driver": ("driver", 1), "ray_data-1": ("ray_data", 1), "ray_data-2": ("ray_data", 2)}
COLUMNS = [
    ("case", "case", "{}"), ("rows", "rows", "{:,}"), ("wall", "wall_s", "{:.1f} s"),
    ("rows/s", "rows_per_s", "{:.0f}"), ("tokenizing tasks", "tokenize_tasks", "{}"),
    ("workers that tokenized", "tokenizing_workers", "{}"),
    ("peak USS / worker", "worker_peak_uss_mib", "{:.0f} MiB"),
    ("peak RSS / worker", "worker_peak_rss_mib", "{:.0f} MiB"),
    ("peak USS, other Ray workers", "other_peak_uss_mib", "{:.0f} MiB"),
    ("driver max RSS", "driver_max_rss_mib", "{:.0f} MiB"), ("tokenized MiB", "tokenized_mib", "{:.0f}"),
]


class RayWorkerMemory(threading.Thread):
    """Each Ray worker process's peak RSS and USS (by pid), and which of them ran a tokenizing task."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_rss: dict[int, int] = {}
        self.peak_uss: dict[int, int] = {}
        self.tokenizers: set[int] = set()
        self._halt = threading.Event()

    def run(self):
        import psutil

        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # reading smaps only on idle CPU time
        me = psutil.Process()
        while not self._halt.is_set():
            for proc in me.children(recursive=True):  # the local Ray's raylet and, under it, its workers
                try:
                    title = " ".join(proc.cmdline())
                    if not title.startswith("ray::"):
                        continue
                    info = proc.memory_full_info()
                except psutil.Error:  # ended between the listing and the read
                    continue
                self.peak_rss[proc.pid] = max(self.peak_rss.get(proc.pid, 0), info.rss)
                self.peak_uss[proc.pid] = max(self.peak_uss.get(proc.pid, 0), info.uss)
                if "_tokenize_block" in title:
                    self.tokenizers.add(proc.pid)
            self._halt.wait(SAMPLE_S)

    def stop(self):
        self._halt.set()
        self.join()


def row_digests(dataset) -> tuple[list[str], int]:
    """One hash per tokenized row, in order, and the blocks' bytes; a block at a time, so the
    driver never holds every row's patches at once."""
    import numpy as np
    import ray

    digests, size = [], 0
    for ref in dataset.to_arrow_refs():
        table = ray.get(ref).combine_chunks()
        size += table.nbytes
        columns = {name: table[name].chunk(0) if table[name].num_chunks else None for name in table.column_names}
        for i in range(table.num_rows):
            digest = hashlib.sha256()
            for name in ("input_ids", "attention_mask", "labels", "pixel_values"):
                digest.update(np.asarray(columns[name][i].values).tobytes() + b"|")
            digest.update(json.dumps(columns["image_grid_thw"][i].as_py()).encode())
            digests.append(digest.hexdigest())
    return digests, size


def run_case(name: str, steps: int, model_path: str | None) -> dict:
    import re

    from cluster.config import load_config
    from fabric.data.prepare import prepare_datasets
    from fabric.ray_args import RayArguments
    from fabric.ray_session import connect
    from stages.loading import load_tokenizer_and_template

    engine, cpus = CASES[name]
    data_dir = os.environ[DATA_ENV]
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as work:
        cfg = load_config({
            "model_name_or_path": "tiny:qwen2_vl", "template": "qwen2_vl", "stage": "sft", "finetuning_type": "full",
            "dataset": shapes.MANY, "dataset_dir": data_dir, "cutoff_len": CUTOFF_LEN, "output_dir": work,
            "image_min_pixels": MIN_PIXELS, "image_max_pixels": MAX_PIXELS, "preprocessing_engine": engine,
            "report_to": "none", "ray_num_cpus": cpus,
        })
        connect(RayArguments(ray_num_cpus=cpus))
        tokenizer, template = load_tokenizer_and_template(cfg.model, cfg.data)
        sampler = RayWorkerMemory()
        sampler.start()
        start = time.time()
        data = prepare_datasets(cfg.data, cfg.finetuning.spec, cfg.training.seed, tokenizer, template)
        wall = time.time() - start
        sampler.stop()
        # before the hashing below, which maps every block's pages from the object store into this process
        driver_max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows = data.stats["train_examples"]
        tasks = re.search(r"MapBatches\(_tokenize_block\): (\d+) tasks executed", data.train.stats())
        digests, size = row_digests(data.train)
    tokenizing = sampler.tokenizers
    return {
        "rows": rows, "wall_s": wall, "rows_per_s": rows / wall,
        "tokenize_tasks": int(tasks.group(1)) if tasks else None,
        "tokenizing_workers": len(tokenizing) if engine == "ray_data" else None,
        "worker_peak_uss_mib": max((sampler.peak_uss[p] for p in tokenizing), default=0) / 2**20 or None,
        "worker_peak_rss_mib": max((sampler.peak_rss[p] for p in tokenizing), default=0) / 2**20 or None,
        # the baseline: Ray's own workers (Ray Data's stats actor, idle workers), which hold no rows
        "other_peak_uss_mib": max((uss for p, uss in sampler.peak_uss.items() if p not in tokenizing), default=0)
        / 2**20 or None,
        "driver_max_rss_mib": driver_max_rss,
        "tokenized_mib": size / 2**20, "digests": digests,
    }


def compare(results: list[dict]) -> list[str]:
    """Lines saying whether each Ray Data case's rows equal the driver's."""
    driver = next((r for r in results if r["case"] == "driver"), None)
    if driver is None:
        return ["rows not compared: the driver case did not run"]
    lines = []
    for result in results:
        if result is driver:
            continue
        same_order = result["digests"] == driver["digests"]
        verdict = "equal, row for row in order" if same_order else (
            "the same rows in another order" if sorted(result["digests"]) == sorted(driver["digests"]) else "DIFFERENT")
        first = next((i for i, (a, b) in enumerate(zip(result["digests"], driver["digests"])) if a != b), None)
        lines.append(f"{result['case']} vs driver: {len(result['digests'])} vs {len(driver['digests'])} rows, {verdict}"
                     + (f" (first differing row {first})" if first is not None and not same_order else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--run-case" in argv:  # a child: the parent generated the pictures
        return bench_main(__file__, __doc__, CASES, lambda name: 0, run_case, COLUMNS, argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--count", type=int, default=COUNT, help="pictures to generate (two rows each)")
    parser.add_argument("--json", default=None)
    args, rest = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-vision-data-") as work:
        data_dir = os.path.join(work, "data")
        started = time.time()
        shapes.write_many(data_dir, args.count)
        print(f"generated {args.count} pictures ({', '.join(map(str, shapes.MANY_SIZES))} px a side) "
              f"in {time.time() - started:.1f} s", flush=True)
        os.environ[DATA_ENV] = data_dir
        figures = os.path.join(work, "figures.json")
        code = bench_main(__file__, __doc__, CASES, lambda name: 0, run_case, COLUMNS, rest + ["--json", figures])
        with open(figures) as f:
            results = json.load(f)["results"]
    for line in compare(results):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "count": args.count, "comparison": compare(results),
                       "results": [{k: v for k, v in r.items() if k != "digests"} for r in results]}, f, indent=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
