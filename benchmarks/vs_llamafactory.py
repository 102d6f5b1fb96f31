"""RayFactory vs LLaMA-Factory 0.9.5: the same YAML, one run after the other, on this machine.

    .venv/bin/python benchmarks/vs_llamafactory.py                      # default cases, 3 rounds each
    .venv/bin/python benchmarks/vs_llamafactory.py --cases tiny-lora --rounds 1
    .venv/bin/python benchmarks/vs_llamafactory.py --cases dpo-full,kto-full --rounds 1

Each round runs ``llamafactory-cli train x.yaml`` (in its own venv) and then ``rayfactory train
x.yaml`` on one identical config, each as a fresh command as a user would type it, and reports
per system: train rows/s (the Trainer's train_samples_per_second: examples for sft, pairs for dpo
and rm, tagged answers for kto; tokens/s follows the same ratio, since both train on the same
rows), the same rows/s over steps 2..n (as this runner sees trainer_log.jsonl's lines arrive:
the cost of a step once training runs), time to the first logged step (logging_steps: 1, from
the command's start to trainer_log.jsonl's first line), the whole command's wall time, and the
peak summed PSS of the command and every process under it (RayFactory's local Ray included). It
prints the medians over the rounds and RayFactory/LLaMA-Factory ratios, plus the largest
difference between the two loss curves, step by step (both see the same batches), and the first
steps' losses of both.

Cases (data generated here, models built offline; YAMLs and data in vs_llamafactory_cases.py):
- tiny-lora: a tiny Llama (hidden 64, 2 layers), LoRA r8 on all linear layers, 1024 short
  arithmetic rows x 2 epochs, batch 8;
- 9m-full: a ~9M-parameter Llama (hidden 256, 8 layers), full fine-tuning, 256 rows of 40-200
  one-token words (cutoff_len 256), batch 8, one epoch: compute-bound, lengths vary;
- smollm2-lora (not in the default set: minutes per run): SmolLM2-135M-Instruct (the demo
  model), LoRA r8, identity_demo, 20 steps.

Preference cases: one ~12.9M-parameter Llama (hidden 320, 8 layers, MLP 1280), full fine-tuning,
cutoff_len 256, batch 8, one epoch over 256 reversal pairs (prompt: 20-80 one-token words; chosen:
them reversed; rejected: a reversal with up to a third of its words dropped or extra ones
inserted, so the answers' lengths differ):
- dpo-full: stage dpo, pref_loss sigmoid, pref_beta 0.1 (the reference: a second copy of the model);
- dpo-simpo: the same with pref_loss simpo, simpo_gamma 0.5, pref_ftx 0 (no reference);
- kto-full: stage kto on 256 tagged answers, one per pair's prompt (the chosen one tagged true or
  the rejected one false, half each: a kto_tag column in dataset_info.json);
- rm-full: stage rm on the pairs;
- smollm2-lora-dpo (not in the default set): SmolLM2-135M-Instruct, LoRA r8 on all linear layers,
  dpo sigmoid, reversal pairs of 10-40 words, 15 steps of 8 pairs (the reference: adapter off).
What train_samples_per_second counts (both systems: the Hugging Face Trainer's
max_steps-or-epochs x batch rows over train_runtime): a pair for dpo and rm (each is two
sequences, chosen and rejected); for kto one tagged answer, which is also two sequences (the
answer and its mismatched KL answer, the previous row's answer). The "unit" column says which.
RayFactory's dpo and kto may compute the reference's log-probs in one pass before the first step
(stages/training/reference_logps.py; with a separate reference model, as in dpo-full and
kto-full); the Trainer's clock starts after it, so RayFactory adds that pass to train_runtime and
its rows/s pay for it. LLaMA-Factory computes the reference per step. The steps 2..n rate leaves
the pass out (it is before step 1). The peak RSS of the largest process is where training runs
(LLaMA-Factory's one process; RayFactory's driver, which trains a lone CPU worker itself).
``--set KEY=VALUE`` gives both systems one more key in every case (``--set bf16=true``).
At step 1 the policy is its reference: dpo sigmoid's loss is log 2 and kto's 0.5 in both
systems; simpo's and rm's first losses depend on the model (rm's on each system's fresh value
head, initialised differently: the first-step difference shows it).

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
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

from harness import REPO_ROOT, TreeMemorySampler, format_table, machine_line
from vs_llamafactory_cases import CASES, DEFAULT_CASES, UNITS, case_config

LF_VERSION = "0.9.5"
DEFAULT_LF_VENV = os.path.expanduser(f"~/.cache/rayfactory/lf-{LF_VERSION}")
COLUMNS = [
    ("case", "case", "{}"), ("system", "system", "{}"), ("unit", "unit", "{}"),
    ("train units/s", "examples_per_s", "{:.2f}"), ("units/s, steps 2..n", "steps_per_s_rows", "{:.2f}"),
    ("time to first step", "first_step_s", "{:.1f} s"), ("whole command", "wall_s", "{:.1f} s"),
    ("peak PSS (all procs)", "peak_pss_gib", "{:.2f} GiB"),
    ("peak RSS (largest process)", "peak_process_rss_gib", "{:.2f} GiB"), ("final loss", "final_loss", "{:.4f}"),
]
RATIO_COLUMNS = [
    ("case", "case", "{}"), ("units/s (RF/LF)", "examples_per_s", "{:.2f}x"),
    ("units/s, steps 2..n (RF/LF)", "steps_per_s_rows", "{:.2f}x"),
    ("time to first step (RF/LF)", "first_step_s", "{:.2f}x"), ("whole command (RF/LF)", "wall_s", "{:.2f}x"),
    ("peak PSS (RF/LF)", "peak_pss_gib", "{:.2f}x"), ("peak process RSS (RF/LF)", "peak_process_rss_gib", "{:.2f}x"),
    ("first-step loss LF", "first_loss_lf", "{:.6f}"),
    ("first-step loss RF", "first_loss_rf", "{:.6f}"), ("first-step difference", "first_loss_diff", "{:.1e}"),
    ("largest loss difference", "loss_diff", "{:.1e}"),
]


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


def run_command(command: list[str], env: dict, output_dir: str, log_path: str, batch_rows: int) -> dict:
    """Run one training command; its wall time, time to the first logged step, peak PSS and the
    rows/s between its first and last logged steps (``batch_rows`` a step, logging_steps 1)."""
    log = os.path.join(output_dir, "trainer_log.jsonl")
    with open(log_path, "w") as out:
        start = time.time()
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        sampler = TreeMemorySampler(proc.pid)
        sampler.start()
        first_step, line_times, size = None, [], 0  # line_times: when each log line was first seen
        while proc.poll() is None:
            if os.path.exists(log) and os.path.getsize(log) != size:
                size = os.path.getsize(log)
                with open(log, "rb") as f:
                    lines = f.read().count(b"\n")
                now = time.time() - start
                line_times += [now] * (lines - len(line_times))
                first_step = first_step or now
            time.sleep(0.05)
        wall = time.time() - start
        sampler.stop()
    if proc.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            sys.stderr.write(f.read()[-4000:])
        raise RuntimeError(f"{command[0]} failed (exit {proc.returncode}); log: {log_path}")
    with open(os.path.join(output_dir, "train_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    records = [json.loads(line) for line in open(log, encoding="utf-8")]
    losses = [r["loss"] for r in records if "loss" in r]
    step_times = [t for t, r in zip(line_times, records) if "loss" in r]
    # Steps 2..n as the runner saw their log lines: what a step costs once training runs, work
    # done before step 1 (a precomputed reference pass, warm-up) left to the time to first step.
    between = ((len(step_times) - 1) * batch_rows / (step_times[-1] - step_times[0])
               if len(step_times) > 2 and step_times[-1] > step_times[0] else None)
    return {"examples_per_s": results["train_samples_per_second"], "steps_per_s_rows": between,
            "train_runtime_s": results.get("train_runtime"), "first_step_s": first_step, "wall_s": wall,
            "peak_pss_gib": sampler.peak_pss / 2**30, "peak_process_rss_gib": sampler.peak_process_rss / 2**30,
            "final_loss": losses[-1], "losses": losses}


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
        batch_rows = config["per_device_train_batch_size"] * config.get("gradient_accumulation_steps", 1)
        figures[system] = run_command(command, env, output_dir, os.path.join(work, f"{system}-{index}.log"),
                                      batch_rows)
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
                  for key in ("examples_per_s", "steps_per_s_rows", "first_step_s", "wall_s", "peak_pss_gib",
                              "peak_process_rss_gib", "final_loss")
                  if all(run[key] is not None for run in runs)}
        medians[system] = median
        rows.append({"case": name, "system": system, "unit": UNITS[name], **median})
    lf, rf = medians["llamafactory"], medians["rayfactory"]
    ratio = {"case": name, **{key: rf[key] / lf[key] for key in ("examples_per_s", "steps_per_s_rows", "first_step_s",
                                                                  "wall_s", "peak_pss_gib", "peak_process_rss_gib")
                               if key in rf and key in lf}}
    first = rounds[0]
    ratio["first_loss_lf"] = first["llamafactory"]["losses"][0]
    ratio["first_loss_rf"] = first["rayfactory"]["losses"][0]
    ratio["first_loss_diff"] = max(abs(r["llamafactory"]["losses"][0] - r["rayfactory"]["losses"][0]) for r in rounds)
    ratio["loss_diff"] = max(max(abs(a - b) for a, b in zip(r["llamafactory"]["losses"], r["rayfactory"]["losses"]))
                             for r in rounds)
    return rows, ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each system per case; medians are reported")
    parser.add_argument("--lf-venv", default=DEFAULT_LF_VENV, help="LLaMA-Factory's venv (built when missing)")
    parser.add_argument("--rf-venv", default=None,
                        help="RayFactory's venv, as a user installs it (no extras; built when missing; default "
                             "~/.cache/rayfactory/rf-plain-<hash of pyproject.toml>), or 'current' for this interpreter's")
    parser.add_argument("--rf-ray", choices=("own", "running"), default="own",
                        help="own: every RayFactory run starts its local Ray (the default a user gets); running: "
                             "one `ray start --head` for all rounds, which each run joins (RAY_ADDRESS=auto)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="train this many steps instead of the case's own (a quick check, not a figure)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a YAML key both systems get in every case (repeatable), e.g. --set bf16=true")
    parser.add_argument("--json", default=None, help="also write every run's figures to this file")
    args = parser.parse_args()
    lf_cli = ensure_lf_venv(args.lf_venv)
    rf_python = sys.executable if args.rf_venv == "current" else ensure_rf_venv(args.rf_venv or default_rf_venv())
    table, ratios, raw = [], [], {}
    with running_ray(rf_python, args.rf_ray == "running"):
        for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
            with tempfile.TemporaryDirectory(prefix=f"vs-lf-{name}-") as work:
                config = case_config(name, work)
                if args.max_steps:
                    config["max_steps"] = args.max_steps
                for item in args.set:
                    key, _, value = item.partition("=")
                    config[key.strip()] = yaml.safe_load(value)
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
    print()
    for name, rounds in raw.items():  # the first steps, side by side
        for index, r in enumerate(rounds):
            lf, rf = r["llamafactory"]["losses"][:5], r["rayfactory"]["losses"][:5]
            print(f"{name} round {index + 1} first losses: LF {[round(x, 6) for x in lf]}  "
                  f"RF {[round(x, 6) for x in rf]}  RF-LF {[f'{b - a:+.1e}' for a, b in zip(lf, rf)]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "medians": table, "ratios": ratios, "runs": raw}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
