"""How long a config mistake takes to report, and the 1-worker quickstart's time to its first step.

    .venv/bin/python benchmarks/config_errors.py [--rounds 3] [--no-quickstart]

Each figure is the wall time of the real command (`rayfactory ...` in a fresh process, as a user
types it), the median of ``--rounds``. The trainer's key names are listed once per transformers
version (RayFactory's cache); the script warms that first, as any earlier run on the install has.
The first step: from starting `rayfactory train configs/quickstart.yaml ray_num_workers=1` to the
first line of its trainer_log.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAYFACTORY = os.path.join(os.path.dirname(sys.executable), "rayfactory")
CASES = {
    "rayfactory --version": ["--version"],
    "key typo (learning_ratee=1)": ["train", "configs/sft_full.yaml", "learning_ratee=1"],
    "dataset typo (dataset=arith_trian)": ["train", "configs/sft_full.yaml", "dataset=arith_trian"],
}


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([RAYFACTORY, *args], cwd=REPO, capture_output=True, timeout=300)
    return time.perf_counter() - start


def first_step_s() -> float:
    """Seconds from the command's start to the first logged step of a 1-worker quickstart."""
    out = tempfile.mkdtemp(prefix="rf-first-step-")
    log = os.path.join(out, "trainer_log.jsonl")
    start = time.perf_counter()
    process = subprocess.Popen([RAYFACTORY, "train", "configs/quickstart.yaml", "ray_num_workers=1",
                                f"output_dir={out}", "max_steps=5", "logging_steps=1"], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while process.poll() is None and not (os.path.exists(log) and os.path.getsize(log) > 0):
            time.sleep(0.05)
        if not os.path.exists(log):
            raise SystemExit(f"the quickstart exited with {process.returncode} before logging a step")
        return time.perf_counter() - start
    finally:
        process.wait(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-quickstart", action="store_true")
    args = parser.parse_args()
    timed(CASES["key typo (learning_ratee=1)"])  # the trainer's key names listed once (a cold install)
    for name, command in CASES.items():
        times = [timed(command) for _ in range(args.rounds)]
        print(f"{name:40s} median {statistics.median(times):5.2f} s  ({', '.join(f'{t:.2f}' for t in times)})")
    if not args.no_quickstart:
        times = [first_step_s() for _ in range(args.rounds)]
        print(f"{'quickstart, 1 worker: first step':40s} median {statistics.median(times):5.2f} s  "
              f"({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
