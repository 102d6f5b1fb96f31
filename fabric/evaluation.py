"""``rayfactory eval`` over several Ray actors (``eval_num_workers``): each loads the model and
scores its share of every task's questions; the harness gathers the answers on rank 0, which
computes the metrics as one process would.

The actors are one torch.distributed group (gloo), the kind the harness's own data-parallel runs
use, so the split, the gathering and the metrics are the harness's code, not ours.
"""

from __future__ import annotations

from stages.inference.eval_args import EvaluationArguments
from stages.inference.loading import InferenceSpec

from .actor_group import ActorGroup, RoleWorker
from .placement import RoleSpec, place_roles, release

ROLE = "evaluator"


class EvalWorker(RoleWorker):
    def __init__(self, spec: InferenceSpec, args: EvaluationArguments):
        self.spec, self.args = spec, args

    def run(self) -> dict | None:
        """This rank's share; rank 0 returns the results of all."""
        from stages.inference.evaluation import evaluate

        return evaluate(self.spec, self.args, rank=self.rank, world_size=self.world_size)


def evaluate_on_ray(spec: InferenceSpec, args: EvaluationArguments, resources: dict[str, float]) -> dict:
    """The harness's results for ``args``' tasks, computed by ``args.eval_num_workers`` actors of
    ``resources`` each, on the Ray this process is connected to."""
    placements = place_roles([RoleSpec(ROLE, args.eval_num_workers, resources, num_actors_key="eval_num_workers",
                                       resources_key="resources_per_worker")])
    try:
        group = ActorGroup(EvalWorker, placements[ROLE], spec, args)
        group.init_process_group("gloo")
        return group.call_all(EvalWorker.run)[0]
    finally:
        release(placements)
