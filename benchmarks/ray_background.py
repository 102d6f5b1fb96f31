"""What the rest of a local Ray costs a training step: the step of benchmarks/step_host.py in a
Ray Train worker, timed while each class of the run's other processes is paused in turn.

    .venv/bin/python benchmarks/ray_background.py [--reps 6] [--interval 0.5] [--classes controller,all]

Inside the worker, slices of a few steps alternate: every process running, then one class of the
driver's other descendants (the Ray daemons, the Train controller, its helper actors, Ray Data's
actors, idle workers, the agents) stopped with SIGSTOP for the slice, then the next class, and
`all` of them at once; SIGCONT after each slice. Interleaving slices inside one process is what
makes a few percent visible on a machine whose speed drifts by more than that between runs.
A paused process uses no CPU and takes no wake-up, so "running" minus "paused" is what that class
costs the step while it runs beside it. Pausing the daemons for a few seconds is harmless to a
local Ray (its health checks allow far more); the script resumes every process before it returns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from harness import format_table, machine_line

# A process's class: the first whose marker is in its command line.
CLASSES = {
    "daemons": ["gcs_server", "raylet"],
    "controller": ["TrainController"],
    "train helpers": ["SynchronizationActor", "PlacementGroupCleaner"],
    "ray data": ["AutoscalingCoordinator", "DatasetManager", "StatsActor"],
    "idle workers": ["ray::IDLE"],
    "agents": ["DashboardAgent", "RuntimeEnvAgent", "log_monitor", "dashboard", "autoscaler"],
}


# After a pause, the resumed processes catch up on their timers and messages: not in the next slice.
SETTLE_S = 0.5


def run_processes(driver_pid: int) -> dict[str, list[int]]:
    """The driver's descendants other than this worker, by class (the rest under "other")."""
    import psutil

    found: dict[str, list[int]] = {}
    for proc in psutil.Process(driver_pid).children(recursive=True):
        if proc.pid == os.getpid():
            continue
        try:
            command = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        name = next((c for c, markers in CLASSES.items() if any(m in command for m in markers)), "other")
        found.setdefault(name, []).append(proc.pid)
    return found


def paused_slices(threads: int, reps: int, driver_pid: int, wanted: list[str]) -> dict:
    """Seconds a step by what was paused during it, and how many processes each class had ("counts")."""
    import signal
    import time

    import psutil

    from batch_layouts import bench_model, random_batches, timed_step

    from stages.training.collators import PaddingFreeCollator

    model, optimizer = bench_model(threads)
    collator = PaddingFreeCollator(pad_token_id=0)
    batches = [collator(features) for features in random_batches(model.config.vocab_size, 4)]
    for batch in batches:  # warm-up: allocator, optimizer state
        timed_step(model, optimizer, batch)
    processes = run_processes(driver_pid)
    every = [pid for pids in processes.values() for pid in pids]
    plan = {"running": []} | {name: pids for name, pids in processes.items() if name in wanted}
    if "all" in wanted:
        plan["all"] = every
    times: dict[str, list[float]] = {name: [] for name in plan}
    try:
        for _ in range(reps):
            for name, pids in plan.items():
                _signal(pids, signal.SIGSTOP)
                times[name] += [timed_step(model, optimizer, batch) for batch in batches]
                _signal(pids, signal.SIGCONT)
                time.sleep(SETTLE_S)
    finally:
        _signal(every, signal.SIGCONT)
    return times | {"counts": {name: len(pids) for name, pids in processes.items()},
                    "other commands": [" ".join(psutil.Process(pid).cmdline())[:100] for pid in processes.get("other", [])]}


def _signal(pids: list[int], sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=6, help="rounds of slices (4 steps a slice)")
    parser.add_argument("--interval", type=float, default=None,
                        help="the Train controller's health-check interval in seconds (default: fabric/ray_session.py's)")
    parser.add_argument("--classes", default=",".join([*CLASSES, "other", "all"]))
    args = parser.parse_args()
    if args.interval is not None:
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.interval)  # connect() keeps a set value
    import json
    import tempfile

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from step_host import local_ray

    def train_fn(config):
        with open(config["out"], "w") as f:
            json.dump(paused_slices(config["threads"], config["reps"], config["driver"], config["classes"]), f)

    with tempfile.NamedTemporaryFile("r") as out, local_ray():
        interval = os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]
        config = {"threads": args.threads, "reps": args.reps, "driver": os.getpid(),
                  "classes": args.classes.split(","), "out": out.name}
        TorchTrainer(train_fn, train_loop_config=config, scaling_config=ScalingConfig(num_workers=1)).fit()
        times = json.load(out)
    counts, others = times.pop("counts"), times.pop("other commands")
    running = statistics.median(times["running"])
    paused = counts | {"running": 0, "all": sum(counts.values())}
    rows = [{"paused": name, "processes": paused[name], "ms": 1000 * statistics.median(seconds), "mean": 1000 * statistics.mean(seconds),
             "ratio": statistics.median(seconds) / running} for name, seconds in times.items()]
    print(machine_line())
    print(f"health-check interval {interval} s; {args.reps} rounds of 4-step slices; other: {others}")
    print(format_table(rows, [("paused", "paused", "{}"), ("processes", "processes", "{}"),
                              ("ms a step (median)", "ms", "{:.0f}"), ("mean", "mean", "{:.0f}"),
                              ("vs running", "ratio", "{:.3f}")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
