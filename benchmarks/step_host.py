"""One padding-free training step of the ~8M Llama, by the process that runs it: a plain Python
process, a Ray task, a Ray Train worker (1 worker, on a local Ray of 2 CPUs like a run's own).

    .venv/bin/python benchmarks/step_host.py [--threads 2] [--steps 12] [--rounds 2]

The step is benchmarks/batch_layouts.py's (forward + backward + AdamW, batches of 8 random
examples of 50-210 tokens, laid out padding-free in rows); only the host changes. What a Ray
process costs the computation itself, apart from start-up, data loading and the Trainer: the
daemons (GCS, raylet), the helper actors and the worker's own Ray threads share the cores with
the step's OpenMP threads. Rounds alternate the hosts, so a drifting machine touches each alike.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

from harness import format_table, machine_line


def one_host_step(threads: int, steps: int) -> float:
    """Mean ms a step, measured in the calling process."""
    from batch_layouts import bench_model, random_batches, time_steps

    from stages.training.collators import PaddingFreeCollator

    model, optimizer = bench_model(threads)
    batches = random_batches(model.config.vocab_size, steps)
    return time_steps(model, optimizer, PaddingFreeCollator(pad_token_id=0), batches)[1]


def in_ray_task(threads: int, steps: int) -> float:
    import ray

    with local_ray():
        return ray.get(ray.remote(num_cpus=1)(one_host_step).remote(threads, steps))


def in_ray_train_worker(threads: int, steps: int) -> float:
    import tempfile

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_fn(config):  # the figure comes back in a file: Ray Train V2 keeps metrics only with checkpoints
        with open(config["out"], "w") as f:
            f.write(str(one_host_step(config["threads"], config["steps"])))

    with tempfile.NamedTemporaryFile("r") as out, local_ray():
        TorchTrainer(train_fn, train_loop_config={"threads": threads, "steps": steps, "out": out.name},
                     scaling_config=ScalingConfig(num_workers=1)).fit()
        return float(out.read())


@contextlib.contextmanager
def local_ray():
    """A fresh local Ray for one measurement, started as a run starts its own (fabric/ray_session.py)."""
    from fabric.ray_args import RayArguments
    from fabric.ray_session import connect, shutdown
    from harness import REPO_ROOT

    path = {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT}/benchmarks"}  # step_host and batch_layouts in the workers
    connect(RayArguments(ray_num_cpus=2, ray_init_kwargs={"runtime_env": {"env_vars": path}}))
    try:
        yield
    finally:
        shutdown()


HOSTS = {"plain process": one_host_step, "Ray task": in_ray_task, "Ray Train worker": in_ray_train_worker}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {name: [] for name in HOSTS}
    for _ in range(args.rounds):
        for name, run in HOSTS.items():
            figures[name].append(run(args.threads, args.steps))
    plain = statistics.median(figures["plain process"])
    rows = [{"host": name, "ms": statistics.median(ms), "each": " / ".join(f"{m:.0f}" for m in ms),
             "ratio": statistics.median(ms) / plain} for name, ms in figures.items()]
    print(machine_line())
    print(format_table(rows, [("host", "host", "{}"), ("ms a step (median)", "ms", "{:.0f}"),
                              ("each round", "each", "{}"), ("vs plain", "ratio", "{:.2f}x")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
