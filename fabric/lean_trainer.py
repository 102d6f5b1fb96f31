"""Ray Train's TorchTrainer without the helper actors a run does not use.

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
for a local Ray (no node of it is ever drained).
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

from .ray_session import started_local_ray


class LeanTorchTrainer(TorchTrainer):
    def _create_default_callbacks(self):
        unused = ()
        if not self.datasets:
            unused += (DatasetsCallback,)
        if started_local_ray():
            unused += (PlacementGroupCleanerCallback,)
        return [callback for callback in super()._create_default_callbacks() if not isinstance(callback, unused)]
