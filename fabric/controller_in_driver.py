"""Ray Train's controller run in the driver process, for a local Ray the driver started.

Ray Train runs its ``TrainController`` as an actor: a process of its own that imports Ray Train
and only then creates the placement group and the worker actors. On a machine of a few cores
that process starts beside the driver's tokenizing and Ray Data's actors, and the workers, whose
own imports (torch, Transformers, peft: ~6 s) are the longest step before the first one, wait for
it: its actor was ready 5.4 s after its process started, ~2.2 CPU-seconds of its own
(benchmarks/README.md, "Ray Train's controller in the driver"). The driver has imported Ray
Train already, so the same controller class runs here, in a thread with its own event loop, and
the worker processes start as soon as Ray is up.

It is the same controller (control loop, failure policy, checkpoint manager, callbacks); what
differs is where it lives. A local Ray the driver started ends with the driver, so the
controller's fate is already the driver's. On a cluster (``ray_address``) it stays an actor,
where Ray Train puts it (a driver may be a ``ray job submit`` entrypoint or a client); and where
Ray's Train state tracking is on (``RAY_TRAIN_ENABLE_STATE_TRACKING=1``, the dashboard's Train
view), which records the controller's actor id and watches that actor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable, Optional

import ray
from ray._private.ray_constants import env_bool
from ray.train.constants import RAY_TRAIN_ENABLE_STATE_TRACKING
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.controller.state import AbortedState
from ray.train.v2._internal.execution.worker_group import WorkerGroup

from .ray_session import started_local_ray

logger = logging.getLogger(__name__)


def controller_can_run_here() -> bool:
    """Whether this run's controller may live in the driver: the driver started the local Ray it
    runs on, and Ray's state tracking (which needs the controller to be an actor) is off."""
    return started_local_ray() and not env_bool(RAY_TRAIN_ENABLE_STATE_TRACKING, False)


class _DriverWorkerGroup(WorkerGroup):
    """Ray's worker group, whose workers' train context gets no controller actor (there is none
    here). That handle serves only ``ray.train.get_all_reported_checkpoints()`` in a worker,
    which RayFactory's workers do not call."""

    def _init_train_context_on_workers(self, workers, sync_actor, train_context_args) -> None:
        # Ray's own (worker_group.py, Ray 2.60) with controller_actor=None in place of
        # ray.get_runtime_context().current_actor, which fails outside an actor.
        ray.get([
            worker.actor.init_train_context.remote(
                train_run_context=self._train_run_context,
                distributed_context=worker.distributed_context,
                synchronization_actor=sync_actor,
                storage_context=self._storage_context,
                worker_callbacks=self._worker_callbacks_to_propagate,
                controller_actor=None,
                **{arg: values[i] for arg, values in train_context_args.items()},
            )
            for i, worker in enumerate(workers)
        ])
        self._decorate_worker_log_file_paths(workers)


class _DriverController(TrainController):
    worker_group_cls = _DriverWorkerGroup


def run_controller_in_driver(while_starting: Optional[Callable[[], None]], **controller_init_kwargs):
    """Create the controller here (it starts the worker group at once), run ``while_starting``
    in this thread while the controller's loop runs in another, and return Ray Train's result.
    Should ``while_starting`` raise (or Ctrl-C arrive), the worker group is aborted and the
    exception propagates, as ``LeanTrainer`` does with a controller actor."""
    controller = _DriverController(**controller_init_kwargs)
    loop = asyncio.new_event_loop()
    run = loop.create_task(controller.run())
    failure: list[BaseException] = []

    def control_loop() -> None:
        try:
            loop.run_until_complete(run)
        except asyncio.CancelledError:  # aborted: see _abort
            pass
        except BaseException as exc:  # noqa: BLE001 (handed to the driver's thread below)
            failure.append(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=control_loop, name="ray-train-controller", daemon=True)
    thread.start()
    try:
        if while_starting is not None:
            while_starting()
        thread.join()
    except BaseException:
        _abort(controller, loop, run, thread)
        raise
    if failure:  # the control loop itself broke: its worker group, owned by this process, goes too
        _abort(controller, loop, run, thread)
        raise failure[0]
    return controller.get_result()


def _abort(controller: TrainController, loop: asyncio.AbstractEventLoop, run: asyncio.Task,
           thread: threading.Thread) -> None:
    """The controller actor's abort(), here: stop its loop, then its worker group."""
    try:
        loop.call_soon_threadsafe(run.cancel)
    except RuntimeError:  # the loop has closed: the run had ended already
        pass
    thread.join()
    if controller.get_state().is_terminal():
        return
    controller._controller_callback_manager.invoke_best_effort("before_controller_abort")
    try:  # as Ray's own abort(): a failure here is logged, and the run's own error is what propagates
        if controller.get_worker_group() is not None:
            controller.get_worker_group().abort()
        controller._set_state(AbortedState())
    except Exception:  # noqa: BLE001
        logger.exception("aborting Ray Train's worker group failed")
