"""What every benchmark script here shares: a child process per case, memory sampling, the table.

A benchmark script defines its cases and how one case runs (``run_case``, in a child process
with its own local Ray, so the memory figure covers exactly that run), then hands the rest to
``bench_main``. Figures, not asserts: on a shared machine they vary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from transformers import TrainerCallback  # noqa: E402 (after the path set-up above)

# ~20M parameters: 6 x (attention 0.8M + MLP 2.4M) + untied embeddings 2 x 1024 x 512.
MODEL_20M = dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536)
SAMPLE_INTERVAL_S = 0.5


class BenchCallback(TrainerCallback):
    """Runs where training runs (each Ray Train worker, or the driver for a lone local CPU worker:
    fabric/train_in_driver.py); writes wall-clock marks and that process's peak RSS.

    The scripts register this module to be pickled by value, so workers need no import of it.
    """

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.marks: dict = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.marks["train_begin"] = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.marks["first_step"] = time.time()
            self.marks["tokens_at_first_step"] = state.num_input_tokens_seen

    def on_train_end(self, args, state, control, **kwargs):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.marks.update(
            train_end=time.time(),
            steps=state.global_step,
            tokens=state.num_input_tokens_seen,  # non-padding, summed over all ranks
            max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        )
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(self.marks, f)


class TreeMemorySampler(threading.Thread):
    """Peak summed RSS and PSS of a process (this one by default) and all its descendants (the local Ray's too).

    RSS counts pages shared between processes (torch's libraries) once per process; PSS splits
    them, so it is the better 'how much RAM does the run take' figure.
    """

    def __init__(self, pid: int | None = None):
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_rss = self.peak_pss = 0
        self.peak_process_rss = 0  # the largest one process's RSS: where training runs (a worker, or the driver)
        self._halt = threading.Event()

    def run(self):
        import psutil

        # Reading every process's smaps costs CPU: this thread takes it only from idle time (Linux
        # niceness is per thread), so the run it measures, Ray's nice-15 workers included, is not slowed.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        me = psutil.Process(self.pid)
        while not self._halt.is_set():
            rss = pss = 0
            try:
                tree = [me, *me.children(recursive=True)]
            except psutil.Error:  # the process has ended
                break
            for proc in tree:
                try:
                    info = proc.memory_full_info()
                    rss, pss = rss + info.rss, pss + getattr(info, "pss", info.rss)
                    self.peak_process_rss = max(self.peak_process_rss, info.rss)
                except psutil.Error:
                    pass
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self._halt.wait(SAMPLE_INTERVAL_S)

    def stop(self):
        self._halt.set()
        self.join()


def timed_config(example: str, out_dir: str, steps: int, **overrides) -> dict:
    """configs/<example> set up for timing: the training loop only (no evaluation, no mid-run
    checkpoints, no plot), non-padding tokens counted, outputs under ``out_dir``."""
    import yaml

    with open(os.path.join(REPO_ROOT, "configs", example), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config.pop("eval_dataset", None)
    config.pop("num_train_epochs", None)  # max_steps decides
    config.update(
        dataset_dir=os.path.join(REPO_ROOT, "data"),
        output_dir=out_dir,
        ray_storage_path=os.path.join(out_dir, "ray"),
        max_steps=steps,
        logging_steps=10,
        save_steps=100000,  # no mid-run checkpoints: they would be timed as training
        plot_loss=False,
        report_to="none",
        include_num_input_tokens_seen="non_padding",
        **overrides,
    )
    return config


def make_full_finetuning(config: dict) -> None:
    """Turn an example's LoRA settings into full fine-tuning, in place."""
    for key in ("lora_target", "lora_rank", "additional_target"):
        config.pop(key, None)
    config["finetuning_type"] = "full"


def measure_run(config: dict) -> dict:
    """Run one config through the driver, as a user would; return the marks and memory figures."""
    import ray.cloudpickle

    from cluster.driver import run_exp
    from stages.loading import resolve_model_path

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import benchmarks/
    sampler = TreeMemorySampler()
    sampler.start()
    marks_dir = os.path.join(config["output_dir"], "bench")
    start = time.time()
    run_exp(config, callbacks=[BenchCallback(marks_dir)])
    wall = time.time() - start
    sampler.stop()
    ranks = [json.load(open(os.path.join(marks_dir, f))) for f in sorted(os.listdir(marks_dir))]
    first = ranks[0]
    steady_s = first["train_end"] - first["first_step"]
    return {
        "params_m": count_params(resolve_model_path(config["model_name_or_path"])) / 1e6,
        "steps": first["steps"],
        "tokens": first["tokens"],
        "steady_s": steady_s if steady_s > 0 else None,
        "tokens_per_s": (first["tokens"] - first["tokens_at_first_step"]) / steady_s if steady_s > 0 else None,
        "steps_per_s": (first["steps"] - 1) / steady_s if steady_s > 0 else None,
        "time_to_first_step_s": first["first_step"] - start,
        "train_loop_s": first["train_end"] - first["train_begin"],
        "wall_s": wall,
        "peak_tree_rss_gib": sampler.peak_rss / 2**30,
        "peak_tree_pss_gib": sampler.peak_pss / 2**30,
        "worker_max_rss_mib": max(r["max_rss_mib"] for r in ranks),
        "driver_max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def count_params(model_path: str) -> int:
    """Parameters of the base model (a LoRA run's output dir holds only the adapter)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):  # shapes only, no memory
        base = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in base.parameters())


def build_20m_model(directory: str) -> str:
    from registries.models import build_tiny_model

    return str(build_tiny_model("qwen2", directory, **MODEL_20M))


def machine_line() -> str:
    import psutil

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, no GPU, Python {platform.python_version()}; "
            f"load average at the end {load}")


def format_table(results: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A Markdown table; ``columns`` are (title, key, format) and a missing figure prints n/a."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in results:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "n/a" for _, key, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_main(
    script: str,
    description: str,
    cases: dict[str, tuple],
    default_steps: Callable[[str], int],
    run_case: Callable[[str, int, str | None], dict],
    columns: list[tuple[str, str, str]],
    argv: list[str] | None = None,
) -> int:
    """The command line every benchmark shares: run each chosen case in a child, print a table.

    ``run_case(name, steps, model_path)`` returns the case's figures; it runs in the child.
    Cases whose first element is ``"20m"`` share one ~20M-parameter model built once here.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(cases), help=f"comma-separated, from: {', '.join(cases)}")
    parser.add_argument("--steps", type=int, default=None, help="training steps per case (default: per model)")
    parser.add_argument("--json", default=None, help="also write every case's figures to this file")
    parser.add_argument("--run-case", default=None, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_case:
        figures = {"case": args.run_case, **run_case(args.run_case, args.steps, args.model_path)}
        with open(args.result_file, "w") as f:
            json.dump(figures, f)
        return 0

    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in cases]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(cases)}")
    # A child must start its own Ray: one reached through RAY_ADDRESS would not be measured.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        needs_20m = any(cases[n][0] == "20m" for n in names)
        model_path = build_20m_model(os.path.join(work, "qwen2-20m")) if needs_20m else None
        for name in names:
            result_file = os.path.join(work, f"{name}.json")
            command = [sys.executable, os.path.abspath(script), "--run-case", name, "--result-file", result_file,
                       "--steps", str(args.steps or default_steps(name))]
            if model_path:
                command += ["--model-path", model_path]
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            log_path = os.path.join(work, f"{name}.log")
            with open(log_path, "w") as log:
                code = subprocess.call(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
            if code != 0:
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    sys.stderr.write(f.read()[-4000:])
                print(f"[bench] {name} failed (exit {code})", file=sys.stderr)
                continue
            with open(result_file) as f:
                results.append(json.load(f))
    print(machine_line())
    print(format_table(results, columns))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "results": results}, f, indent=2)
    return 0 if len(results) == len(names) else 1


def settings_arguments(doc: str, settings: dict, unit: str) -> tuple[argparse.Namespace, list[str]]:
    """The command line of the per-setting RL benchmarks: --settings, --steps, --json; the chosen names."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--settings", default=",".join(settings), help=f"comma-separated, of {list(settings)}")
    parser.add_argument("--steps", type=int, default=20, help=f"{unit} steps per setting (step 1 is not counted)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in settings]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(settings)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2: step 1 is warm-up and not counted")
    os.environ.pop("RAY_ADDRESS", None)  # measure a local Ray of our own, not a shared cluster
    return args, names


def write_json(path: str | None, results: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine_line(), "results": results}, f, indent=2)


def relative_to_base(rows: list[dict], is_base, key: str, out: str) -> None:
    """Set each row's ``out`` to its ``key`` as a multiple of the base row's ("1.50x"; "n/a" when
    no row ``is_base``)."""
    base = next((r[key] for r in rows if is_base(r)), None)
    for row in rows:
        row[out] = f"{row[key] / base:.2f}x" if base else "n/a"
