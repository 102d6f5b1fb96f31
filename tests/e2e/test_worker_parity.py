"""Data parallelism is exact: 2 workers x 8 rows train the same model as 1 worker x 16 rows.

Why the curves can match at all: every worker gets the whole tokenized dataset and the Trainer's
seeded sampler deals each step's global batch out to the ranks (fabric/worker.py), and
transformers 5 averages the loss over the tokens of the *global* batch
(``average_tokens_across_devices``, on by default): each rank divides its token-loss sum by the
token count summed over all ranks, DDP averages the gradients, so the update equals one process
dividing the whole batch's loss sum by its token count. What is left is float rounding: two
half-batch matmuls and a gloo all-reduce add in a different order than one full-batch matmul.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest
from ray import cloudpickle
from transformers import TrainerCallback

from cluster.driver import run_exp
from stages.training.callbacks import read_log

from tests.e2e.conftest import tiny_sft_config

TRAIN_ROWS = 320  # data/arith_train.json

# Measured on this 2-core machine over the 20 logged losses: 1.5e-7 largest relative difference
# (float rounding, see the module docstring). The same 2x8 run with per-device loss averaging
# (average_tokens_across_devices: false) differs by up to 4.7e-4 (answers are 1-2 tokens, so
# per-rank token counts barely differ), so the bar sits between: 65x above rounding, 47x below
# that bug. Rows dealt wrongly change even the first step's loss, which has no history.
REL_TOL = 1e-5

# Workers cannot import this test module by name: ship the recorder class by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class RecordRankIndices(TrainerCallback):
    """Writes the dataset rows this rank's dataloader yields in epoch 0, without consuming it."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        sampler = _seedable_sampler(train_dataloader)
        epoch = sampler.epoch
        batches = [list(map(int, batch)) for batch in train_dataloader.batch_sampler]
        sampler.set_epoch(epoch)  # iterating advanced it; training must start from the same order
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"rank{args.process_index}.json"), "w", encoding="utf-8") as f:
            json.dump(batches, f)


class RecordWrapping(TrainerCallback):
    """Writes how accelerate runs this rank (one plain process, or a DistributedDataParallel rank)
    and whether Ray Train gave it a torch.distributed process group."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        import torch.distributed
        from accelerate.state import PartialState

        if state.is_world_process_zero:
            with open(self.path, "w", encoding="utf-8") as f:
                json.dump({"distributed_type": PartialState().distributed_type.name, "world_size": args.world_size,
                           "process_group": torch.distributed.is_initialized(),
                           "find_unused_parameters": args.ddp_find_unused_parameters,
                           "nice": os.getpriority(os.PRIO_PROCESS, 0)}, f)


def _seedable_sampler(dataloader):
    """accelerate's per-rank shard wraps the batch sampler that wraps the seeded random sampler."""
    inner = dataloader.batch_sampler
    while not hasattr(inner, "set_epoch") or not hasattr(inner, "epoch"):
        inner = getattr(inner, "batch_sampler", None) or getattr(inner, "sampler")
    return inner


COORDINATOR = "AutoscalingCoordinator"  # Ray Data's actor's name and namespace (Ray 2.60)


def _actors() -> dict[str, str]:
    """Every actor this Ray has started, dead or alive: id -> class name (from the GCS; no dashboard here)."""
    import ray

    return {actor_id: info["ActorClassName"] for actor_id, info in ray._private.state.actors().items()}


def _losses(output_dir: str) -> list[tuple[int, float]]:
    return [(r["current_steps"], r["loss"]) for r in read_log(output_dir) if "loss" in r]


@pytest.fixture(scope="module")
def two_workers(ray_session, tmp_path_factory):
    """One epoch on 2 workers x 8 rows, recording which rows each rank was dealt."""
    out = tmp_path_factory.mktemp("two_workers")
    config = tiny_sft_config(out / "run", ray_num_workers=2, per_device_train_batch_size=8,
                             max_steps=-1, num_train_epochs=1)
    result = run_exp(config, callbacks=[RecordRankIndices(str(out / "indices")), RecordWrapping(str(out / "wrap.json"))])
    with open(out / "wrap.json", encoding="utf-8") as f:
        # DDP: gradients all-reduced, without the search for weights that got no gradient (every
        # weight of the tiny Qwen2 is in the loss: stages/job.py); and the run's own local Ray
        # starts its workers at nice 0, not Ray's 15.
        assert json.load(f) == {"distributed_type": "MULTI_CPU", "world_size": 2, "process_group": True,
                                "find_unused_parameters": False, "nice": 0}
    return result.output_dir, str(out / "indices")


def _one_epoch_of_16_rows(output_dir, **overrides) -> dict:
    return tiny_sft_config(output_dir, per_device_train_batch_size=16, max_steps=-1, num_train_epochs=1, **overrides)


@pytest.fixture(scope="module")
def one_worker(ray_session, tmp_path_factory):
    """The same epoch on one Ray Train worker x 16 rows (train_in_driver: false keeps the worker
    group a lone local worker would otherwise skip: fabric/train_in_driver.py); the actors it started."""
    out = tmp_path_factory.mktemp("one_worker")
    with contextlib.suppress(ValueError):  # a session's earlier Ray Data run may have started it
        ray_session.kill(ray_session.get_actor(COORDINATOR, namespace=COORDINATOR))
    before = _actors()
    one = run_exp(_one_epoch_of_16_rows(out / "one", train_in_driver=False),
                  callbacks=[RecordWrapping(str(out / "wrap.json"))])
    started = {name for actor_id, name in _actors().items() if actor_id not in before}
    return one.output_dir, started, str(out / "wrap.json")


def test_two_workers_match_one_worker_on_the_same_global_batch(one_worker, two_workers):
    two_dir, _ = two_workers
    one_dir, started, wrap = one_worker
    # Ray Train's worker; none of the helper actors a run on its own local Ray with a tokenized
    # dataset leaves unused (fabric/ray_trainer.py; the data, small, was tokenized in the driver:
    # no Ray Data), and no controller actor: on the run's own local Ray the controller runs in the
    # driver (fabric/controller_in_driver.py).
    assert "RayTrainWorker" in started, started
    unused = {"TrainController", "DatasetManager", "PlacementGroupCleaner", "PreemptionWatcher",
              "_AutoscalingCoordinatorActor", "_StatsActor"}
    assert not started & unused, started
    # A lone worker trains unwrapped (fabric/worker.py): no all-reduce with nobody, no unused-parameter
    # search; and without a process group, so Ray's torch backend stays out of the controller
    # (fabric/launcher.py).
    with open(wrap, encoding="utf-8") as f:
        assert json.load(f) == {"distributed_type": "NO", "world_size": 1, "process_group": False,
                                "find_unused_parameters": False, "nice": 0}
    two_losses, one_losses = _losses(two_dir), _losses(one_dir)

    assert [s for s, _ in one_losses] == list(range(1, 21))  # 320 rows / 16 per step
    assert [s for s, _ in two_losses] == [s for s, _ in one_losses]
    worst = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(two_losses, one_losses))
    print(f"largest relative loss difference, 2x8 vs 1x16: {worst:.2e}")
    assert worst < REL_TOL, (two_losses, one_losses)
    # It trained (a flat curve would match trivially).
    assert one_losses[-1][1] < 0.6 * one_losses[0][1]


class RecordProcess(TrainerCallback):
    """Which process trains: the driver's own callback object records only where it runs itself
    (a Ray Train worker gets a pickled copy, whose records stay in the worker)."""

    def __init__(self):
        self.pids: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.pids.append(os.getpid())


def test_a_lone_local_worker_trains_in_the_driver_with_the_same_losses(ray_session, tmp_path, one_worker):
    """The default for one CPU worker on the run's own local Ray: Ray Train's local mode, in this
    process, no actor started (the small data is tokenized in the driver). Same seed, same rows,
    same threads as the lone worker: the same curve, to float rounding."""
    one_dir, _, _ = one_worker
    where = RecordProcess()
    before = _actors()
    here = run_exp(_one_epoch_of_16_rows(tmp_path / "here"),
                   callbacks=[where, RecordWrapping(str(tmp_path / "wrap.json"))])
    assert where.pids == [os.getpid()]
    assert {name for actor_id, name in _actors().items() if actor_id not in before} == set()
    with open(tmp_path / "wrap.json", encoding="utf-8") as f:
        assert json.load(f) == {"distributed_type": "NO", "world_size": 1, "process_group": False,
                                "find_unused_parameters": False, "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    here_losses, one_losses = _losses(here.output_dir), _losses(one_dir)
    assert [s for s, _ in here_losses] == [s for s, _ in one_losses] == list(range(1, 21))
    worst = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(here_losses, one_losses))
    print(f"largest relative loss difference, driver vs lone worker: {worst:.2e}")
    assert worst < REL_TOL, (here_losses, one_losses)
    assert here_losses[-1][1] < 0.6 * here_losses[0][1]


def test_each_worker_trains_on_its_own_half_of_the_data(ray_session, tmp_path, two_workers):
    two_dir, indices_dir = two_workers
    single = run_exp(tiny_sft_config(tmp_path / "single", per_device_train_batch_size=8, max_steps=-1, num_train_epochs=1))

    # Same per-worker batch: twice the workers, half the optimizer steps for one epoch.
    assert read_log(single.output_dir)[-1]["total_steps"] == TRAIN_ROWS // 8 == 40
    assert read_log(two_dir)[-1]["total_steps"] == 20
    assert [s for s, _ in _losses(two_dir)] == list(range(1, 21))

    ranks = []
    for rank in (0, 1):
        with open(os.path.join(indices_dir, f"rank{rank}.json"), encoding="utf-8") as f:
            ranks.append(json.load(f))
    assert [len(batches) for batches in ranks] == [20, 20]
    assert all(len(batch) == 8 for batches in ranks for batch in batches)
    rows0 = [i for batch in ranks[0] for i in batch]
    rows1 = [i for batch in ranks[1] for i in batch]
    assert not set(rows0) & set(rows1), "both workers trained on the same rows"
    assert sorted(rows0 + rows1) == list(range(TRAIN_ROWS)), "an epoch must cover every row exactly once"


def test_with_rays_train_state_tracking_the_controller_is_an_actor(ray_session, tmp_path, monkeypatch):
    """Ray's Train state tracking (the dashboard's Train view) records the controller's actor id
    and watches that actor, so with it on the controller stays an actor, and the run trains."""
    monkeypatch.setenv("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    before = _actors()
    result = run_exp(tiny_sft_config(tmp_path / "run", max_steps=3, logging_steps=1, train_in_driver=False))
    started = {name for actor_id, name in _actors().items() if actor_id not in before}
    assert {"TrainController", "RayTrainWorker"} <= started, started
    assert [s for s, _ in _losses(result.output_dir)] == [1, 2, 3]
