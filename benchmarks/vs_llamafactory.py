"""RayFactory vs LLaMA-Factory 0.9.5: the same YAML, one run after the other, on this machine.

    .venv/bin/python benchmarks/vs_llamafactory.py                      # default cases, 3 rounds each
    .venv/bin/python benchmarks/vs_llamafactory.py --cases tiny-lora --rounds 1

Each round runs ``llamafactory-cli train x.yaml`` (in its own venv) and then ``rayfactory train
x.yaml`` on one identical config, each as a fresh command as a user would type it, and reports
per system: train examples/s (the Trainer's train_samples_per_second; tokens/s follows the same
ratio, since both train on the same rows), time to the first logged step (logging_steps: 1, from
the command's start to trainer_log.jsonl's first line), the whole command's wall time, and the
peak summed PSS of the command and every process under it (RayFactory's local Ray included). It
prints the medians over the rounds and RayFactory/LLaMA-Factory ratios, plus the largest
difference between the two loss curves, step by step (both see the same batches).

Cases (data generated here, models built offline):
- tiny-lora: a tiny Llama (hidden 64, 2 layers), LoRA r8 on all linear layers, 1024 short
  arithmetic rows x 2 epochs, batch 8;
- 9m-full: a ~9M-parameter Llama (hidden 256, 8 layers), full fine-tuning, 256 rows of 40-200
  one-token words (cutoff_len 256), batch 8, one epoch: compute-bound, lengths vary;
- smollm2-lora (not in the default set: minutes per run): SmolLM2-135M-Instruct (the demo
  model), LoRA r8, identity_demo, 20 steps.

The LLaMA-Factory venv is built on first use (``--lf-venv``, default
~/.cache/rayfactory/lf-0.9.5): torch 2.13.0 (CPU) first, then llamafactory==0.9.5 held to that
torch; its CUDA builds of torchvision/torchaudio are removed or set aside (they break imports
next to a CPU torch). LLaMA-Factory runs with CUDA_VISIBLE_DEVICES="" and DISABLE_VERSION_CHECK=1
and its own defaults (gradient checkpointing on, all cores); RayFactory with its defaults (one
worker on a local Ray), from a venv of its own built the same way on first use (``--rf-venv``:
torch, then RayFactory without extras, as a user installs it; the development venv's test extras
would add bitsandbytes to every process's imports). ``--rf-ray running`` starts one local Ray head
(`ray start --head`) before the rounds and lets every RayFactory run join it (RAY_ADDRESS=auto),
as a user who keeps a Ray up between runs does. Run on a quiet machine: figures, not asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from harness import REPO_ROOT, TreeMemorySampler, format_table, machine_line

LF_VERSION = "0.9.5"
DEFAULT_LF_VENV = os.path.expanduser(f"~/.cache/rayfactory/lf-{LF_VERSION}")
DEFAULT_CASES = ("tiny-lora", "9m-full")
COLUMNS = [
    ("case", "case", "{}"), ("system", "system", "{}"), ("train examples/s", "examples_per_s", "{:.2f}"),
    ("time to first step", "first_step_s", "{:.1f} s"), ("whole command", "wall_s", "{:.1f} s"),
    ("peak PSS (all procs)", "peak_pss_gib", "{:.2f} GiB"), ("final loss", "final_loss", "{:.4f}"),
]
RATIO_COLUMNS = [
    ("case", "case", "{}"), ("examples/s (RF/LF)", "examples_per_s", "{:.2f}x"),
    ("time to first step (RF/LF)", "first_step_s", "{:.2f}x"), ("whole command (RF/LF)", "wall_s", "{:.2f}x"),
    ("peak PSS (RF/LF)", "peak_pss_gib", "{:.2f}x"), ("largest loss difference", "loss_diff", "{:.1e}"),
]


# ---------------------------------------------------------------- the cases


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
    if name == "tiny-lora":
        model = build_tiny_model("llama", os.path.join(work, "model"), hidden_size=64, num_layers=2, num_heads=4)
        write_dataset(data_dir, "bench_short", arithmetic_rows(1024))
        return dict(common, model_name_or_path=str(model), template=get_model_family("llama").template,
                    finetuning_type="lora", lora_target="all", lora_rank=8, dataset="bench_short", cutoff_len=64,
                    learning_rate=5.0e-3, num_train_epochs=2)
    if name == "9m-full":
        model = build_tiny_model("llama", os.path.join(work, "model"), hidden_size=256, num_layers=8, num_heads=4,
                                 intermediate_size=1024)
        write_dataset(data_dir, "bench_words", word_rows(256, whole_word_tokens(str(model))))
        return dict(common, model_name_or_path=str(model), template=get_model_family("llama").template,
                    finetuning_type="full", dataset="bench_words", cutoff_len=256, learning_rate=1.0e-4,
                    num_train_epochs=1)
    if name == "smollm2-lora":
        from stages.loading import resolve_model_path

        with open(os.path.join(REPO_ROOT, "data", "identity_demo.json"), encoding="utf-8") as f:
            rows = json.load(f)
        # LLaMA-Factory's alpaca reader indexes row["input"], which our rows leave out when empty.
        write_dataset(data_dir, "identity_demo", [{"input": "", **row} for row in rows])
        return dict(common, model_name_or_path=resolve_model_path("demo:smollm2-135m-instruct"), template="smollm2",
                    finetuning_type="lora", lora_target="all", lora_rank=8, dataset="identity_demo", cutoff_len=256,
                    learning_rate=5.0e-4, max_steps=20)
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


def write_dataset(data_dir: str, name: str, rows: list[dict]) -> None:
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f)
    with open(os.path.join(data_dir, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({name: {"file_name": f"{name}.json"}}, f)


# ---------------------------------------------------------------- running one command


def lf_environment() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DISABLE_VERSION_CHECK="1", HF_HUB_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    return env


def ensure_lf_venv(venv: str) -> str:
    """The llamafactory-cli of a LLaMA-Factory 0.9.5 venv, built here the first time."""
    cli = os.path.join(venv, "bin", "llamafactory-cli")
    if os.path.exists(cli):
        return cli
    print(f"[bench] building LLaMA-Factory {LF_VERSION} in {venv} (minutes, once)", file=sys.stderr, flush=True)
    pip = venv_with_torch(venv)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraint:
        constraint.write("torch==2.13.0+cpu\n")
    subprocess.check_call(pip + [f"llamafactory=={LF_VERSION}", "-c", constraint.name])
    subprocess.call([os.path.join(venv, "bin", "python"), "-m", "pip", "uninstall", "-q", "-y", "torchvision"])
    # llamafactory imports torchaudio (multimodal plugins); its CUDA native libraries fail to load here.
    for library in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "torchaudio", "lib", "*.so")):
        os.rename(library, library + ".aside")
    return cli


def ensure_rf_venv(venv: str) -> str:
    """The python of a venv holding RayFactory as a user installs it (no extras), built here the first time.

    Not the development venv: its test extras (bitsandbytes, deepspeed, vllm) are importable there,
    and peft imports bitsandbytes whenever it can (~3 s more per process here, in the driver and
    in every worker), while LLaMA-Factory's venv has neither. The run itself imports this
    checkout (the command runs in it), whatever the venv was installed from.
    """
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python):
        return python
    print(f"[bench] building RayFactory's own venv in {venv} (minutes, once)", file=sys.stderr, flush=True)
    subprocess.check_call(venv_with_torch(venv) + [REPO_ROOT])
    return python


def venv_with_torch(venv: str) -> list[str]:
    """A new venv holding the pinned CPU torch alone (installed first, so nothing pulls a CUDA build);
    returns its ``pip install`` command."""
    subprocess.check_call([sys.executable, "-m", "venv", venv])
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
    subprocess.check_call(pip + ["torch==2.13.0"])
    return pip


def default_rf_venv() -> str:
    """Named by a hash of pyproject.toml: a changed dependency list builds a new venv."""
    import hashlib

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:10]
    return os.path.expanduser(f"~/.cache/rayfactory/rf-plain-{digest}")


def run_command(command: list[str], env: dict, output_dir: str, log_path: str) -> dict:
    """Run one training command; its wall time, time to the first logged step and peak PSS."""
    log = os.path.join(output_dir, "trainer_log.jsonl")
    with open(log_path, "w") as out:
        start = time.time()
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        sampler = TreeMemorySampler(proc.pid)
        sampler.start()
        first_step = None
        while proc.poll() is None:
            if first_step is None and os.path.exists(log) and os.path.getsize(log) > 0:
                first_step = time.time() - start
            time.sleep(0.05)
        wall = time.time() - start
        sampler.stop()
    if proc.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            sys.stderr.write(f.read()[-4000:])
        raise RuntimeError(f"{command[0]} failed (exit {proc.returncode}); log: {log_path}")
    with open(os.path.join(output_dir, "train_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    losses = [r["loss"] for r in map(json.loads, open(log, encoding="utf-8")) if "loss" in r]
    return {"examples_per_s": results["train_samples_per_second"], "first_step_s": first_step, "wall_s": wall,
            "peak_pss_gib": sampler.peak_pss / 2**30, "final_loss": losses[-1], "losses": losses}


def run_round(name: str, config: dict, work: str, lf_cli: str, rf_python: str, index: int,
              rf_joins: bool = False) -> dict[str, dict]:
    import yaml

    figures = {}
    for system in ("llamafactory", "rayfactory"):
        output_dir = os.path.join(work, f"{system}-{index}")
        path = os.path.join(work, f"{system}-{index}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(dict(config, output_dir=output_dir), f)
        if system == "llamafactory":
            command, env = [lf_cli, "train", path], lf_environment()
        else:
            command = [rf_python, "-m", "cluster.cli", "train", path]
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
            if rf_joins:
                env["RAY_ADDRESS"] = "auto"  # the running head (--rf-ray running)
        print(f"[bench] {name} round {index + 1}: {system} ...", file=sys.stderr, flush=True)
        figures[system] = run_command(command, env, output_dir, os.path.join(work, f"{system}-{index}.log"))
    return figures


@contextlib.contextmanager
def running_ray(rf_python: str, wanted: bool):
    """A local Ray head, as a user starts one to keep between runs (docs/cluster.md), stopped after."""
    if not wanted:
        yield
        return
    ray_cli = os.path.join(os.path.dirname(rf_python), "ray")
    subprocess.check_call([ray_cli, "start", "--head", f"--num-cpus={os.cpu_count()}", "--include-dashboard=false",
                           "--disable-usage-stats"], stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        subprocess.call([ray_cli, "stop"], stdout=subprocess.DEVNULL)


def summarize(name: str, rounds: list[dict[str, dict]]) -> tuple[list[dict], dict]:
    rows = []
    medians = {}
    for system in ("llamafactory", "rayfactory"):
        runs = [r[system] for r in rounds]
        median = {key: statistics.median(run[key] for run in runs)
                  for key in ("examples_per_s", "first_step_s", "wall_s", "peak_pss_gib", "final_loss")
                  if all(run[key] is not None for run in runs)}
        medians[system] = median
        rows.append({"case": name, "system": system, **median})
    lf, rf = medians["llamafactory"], medians["rayfactory"]
    ratio = {"case": name, **{key: rf[key] / lf[key] for key in ("examples_per_s", "first_step_s", "wall_s",
                                                                  "peak_pss_gib") if key in rf and key in lf}}
    ratio["loss_diff"] = max(max(abs(a - b) for a, b in zip(r["llamafactory"]["losses"], r["rayfactory"]["losses"]))
                             for r in rounds)
    return rows, ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help="comma-separated, from: tiny-lora, 9m-full, smollm2-lora")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each system per case; medians are reported")
    parser.add_argument("--lf-venv", default=DEFAULT_LF_VENV, help="LLaMA-Factory's venv (built when missing)")
    parser.add_argument("--rf-venv", default=None,
                        help="RayFactory's venv, as a user installs it (no extras; built when missing; default "
                             "~/.cache/rayfactory/rf-plain-<hash of pyproject.toml>), or 'current' for this interpreter's")
    parser.add_argument("--rf-ray", choices=("own", "running"), default="own",
                        help="own: every RayFactory run starts its local Ray (the default a user gets); running: "
                             "one `ray start --head` for all rounds, which each run joins (RAY_ADDRESS=auto)")
    parser.add_argument("--json", default=None, help="also write every run's figures to this file")
    args = parser.parse_args()
    lf_cli = ensure_lf_venv(args.lf_venv)
    rf_python = sys.executable if args.rf_venv == "current" else ensure_rf_venv(args.rf_venv or default_rf_venv())
    table, ratios, raw = [], [], {}
    with running_ray(rf_python, args.rf_ray == "running"):
        for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
            with tempfile.TemporaryDirectory(prefix=f"vs-lf-{name}-") as work:
                config = case_config(name, work)
                rounds = [run_round(name, config, work, lf_cli, rf_python, i, rf_joins=args.rf_ray == "running")
                          for i in range(args.rounds)]
            rows, ratio = summarize(name, rounds)
            table += rows
            ratios.append(ratio)
            raw[name] = rounds
    print(machine_line())
    print(format_table(table, COLUMNS))
    print()
    print(format_table(ratios, RATIO_COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "medians": table, "ratios": ratios, "runs": raw}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
