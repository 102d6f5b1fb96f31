"""Ray Train's trainer without the helper actors a run does not use.

Every Ray actor is a process of its own that imports Ray Train or Ray Data before it does
anything: ~3.5 CPU-seconds each on a 2-core machine, spent while the worker imports torch and
loads the model (measured per process on a tiny LoRA run: benchmarks/README.md, "Start-up").
Two of Ray Train's default controller callbacks start such an actor for nothing here:

* ``DatasetsCallback`` starts a ``DatasetManager`` for the Trainer's ``datasets``, even when
  there are none. A tokenized (not streamed) dataset reaches the workers as object refs in
  their payload (fabric/launcher.py), so only a streamed run needs it.
* ``PlacementGroupCleanerCallback`` starts a detached actor that removes the run's placement
  groups should the controller die. A local Ray this driver started (fabric/ray_session.py) ends
  with the driver, placement groups and all; on a cluster it stays.

Ray's preemption watcher is the third such actor; ray_session turns it off by Ray's own switch
for a local Ray (no node of it is ever drained). The fourth is Ray Data's autoscaling coordinator,
which Ray Train's scaling policy asks for the run's resources before it starts the worker group:
that request is for a cluster's autoscaler, and a local Ray the driver started has none, so its
policy makes no request (``LocalScalingPolicy``).

And on a local Ray the driver started, the controller itself is no actor (unless Ray's Train
state tracking is on): it runs in the driver (fabric/controller_in_driver.py says why).

``fit(while_starting=...)`` runs the driver's own work (tokenizing: fabric/launcher.py) after the
controller has been created, so it overlaps the worker group's start instead of preceding it.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import ray
from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.constants import DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE, get_env_vars_to_propagate
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

from fabric.controller_in_driver import controller_can_run_here, run_controller_in_driver
from .ray_session import started_local_ray


class LeanTrainer(DataParallelTrainer):
    _while_starting: Optional[Callable[[], None]] = None

    def fit(self, while_starting: Optional[Callable[[], None]] = None):
        """Ray's fit(); ``while_starting`` runs here once the controller exists. Should it raise,
        the run is aborted (workers and all) and its exception propagates."""
        self._while_starting = while_starting
        try:
            return super().fit()
        finally:
            self._while_starting = None

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if started_local_ray() and type(controller_init_kwargs["scaling_policy"]) is FixedScalingPolicy:
            controller_init_kwargs["scaling_policy"] = LocalScalingPolicy(self.scaling_config)
        if controller_can_run_here():  # the controller in this process: fabric/controller_in_driver.py says why
            return run_controller_in_driver(self._while_starting, **controller_init_kwargs)
        # Ray's own (ray/train/v2/api/data_parallel_trainer.py, Ray 2.60), with the hook between
        # starting the controller and waiting for it.
        env_vars = get_env_vars_to_propagate()
        env_vars.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
        controller_actor_cls = ray.remote(
            num_cpus=0,
            label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
            runtime_env={"env_vars": env_vars},
        )(TrainController)
        controller = controller_actor_cls.remote(**controller_init_kwargs)
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        running = controller.run.remote()
        if self._while_starting is not None:
            try:
                self._while_starting()
            except BaseException:
                _abort(controller)
                raise
        ray.get(running)
        return ray.get(controller.get_result.remote())

    def _create_default_callbacks(self):
        unused = ()
        if not self.datasets:
            unused += (DatasetsCallback,)
        if started_local_ray():
            unused += (PlacementGroupCleanerCallback,)
        return [callback for callback in super()._create_default_callbacks() if not isinstance(callback, unused)]


class LocalScalingPolicy(FixedScalingPolicy):
    """Ray's fixed-size policy without its resource requests to Ray Data's autoscaling coordinator.

    They tell a cluster's autoscaler what the run needs (every 20 s while it runs). The first one
    starts the coordinator, an actor whose process imports Ray Data, and waits for its answer
    before the worker group is started: on 2 cores, ~1 CPU-second beside the starting workers.
    A local Ray the driver started has no autoscaler to tell.
    """

    def after_controller_start(self, train_run_context) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _cancel_resource_request(self) -> None:
        pass


def _abort(controller) -> None:
    """Stop a run whose driver-side work failed: the controller aborts the worker group and exits."""
    try:
        ray.get(controller.abort.remote())
    except ray.exceptions.RayActorError:  # abort() ends the controller's process: the expected answer
        pass
