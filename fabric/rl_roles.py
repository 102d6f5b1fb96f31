"""The RL roles as Ray actor groups, behind the recipe's ``RLRoles`` interface.

* policy: ``ray_num_workers`` ranks of ``PolicyWorker`` (DDP over gloo on CPU, NCCL on GPU);
  the reference, when beta > 0, lives in the same processes (LoRA: the adapter switched off).
* rollout: ``rollout_num_engines`` vLLM engines, or none when ``rollout_backend: hf`` (the
  policy ranks then generate with transformers).
* critic (stage ppo with GAE): ``critic_num_workers`` ranks of ``CriticWorker``, a DDP group of
  their own.
* reward: a reward model (stage ppo's reward_model) as ``reward_num_workers`` actors of
  ``RewardModelWorker``; rule functions run in the controller (they are cheap Python).

Work is split evenly over a group's actors and the results are put back in order, so the recipe
sees one policy and one rollout service whatever their sizes.
"""

from __future__ import annotations

import os
from typing import Optional

from stages.rl.workers.critic import CriticWorker
from stages.rl.workers.policy import PolicyWorker
from stages.rl.workers.reward_model import RewardModelWorker
from stages.rl.controller.roles import Generation, PPORoles
from stages.engines.types import Completion, SamplingSpec
from stages.rl.config.types import RolloutSample
from stages.rl.workers.zero import gathered

from .actor_group import ActorGroup, RayPending, RoleWorker, concat, gather, split_evenly
from .weight_sync import CollectiveSync, WeightSender


class PolicyActor(RoleWorker, PolicyWorker):
    """A policy rank: the stage's PolicyWorker in a Ray actor that can join a process group, and
    (rank 0) send its weights to the engines over a weight group (``rollout_weight_sync: collective``)."""

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        self.weight_sender = WeightSender()
        self.weight_sender.join(host, port, world_size, backend)

    def send_weights(self) -> list:
        """Pack the weights and queue their broadcast; the plan the engines receive them by. A
        ZeRO-3 rank other than 0 (no sender) only takes part in gathering the shards."""
        sender = getattr(self, "weight_sender", None)
        if sender is None:
            with gathered(self.model):
                return []
        return sender.send(self.model)


class CriticActor(RoleWorker, CriticWorker):
    """A critic rank: the stage's CriticWorker in a Ray actor that can join a process group."""


class RewardActor(RoleWorker, RewardModelWorker):
    """A reward model replica."""


class RayRoles(PPORoles):
    def __init__(self, policy: ActorGroup[PolicyActor], engines: Optional[ActorGroup] = None, weight_sync=None,
                 critic: Optional[ActorGroup[CriticActor]] = None, reward: Optional[ActorGroup[RewardActor]] = None):
        self.policy = policy
        self.engines = engines
        self.weight_sync = weight_sync
        self.critic = critic
        self.reward = reward
        self.policy_size = policy.size
        self._all_ranks: dict[str, bool] = {}  # role -> reading its whole model is a collective (ZeRO-3)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        return self.generate_async(prompt_ids, sampling).result().completions

    def generate_async(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> RayPending:
        """Each actor gets a contiguous shard; the result numbers prompts across the whole batch and
        spans the engines' busy time (none for the HF backend, whose generate is untimed)."""
        after_loads = None
        if self.engines is not None:
            from .rollout import RolloutActor

            timed = True
            shards = split_evenly(prompt_ids, self.engines.size)
            if self.weight_sync is not None and self.weight_sync.in_flight:  # after every push sent so far
                after_loads = self.weight_sync.loads_sent
            refs = self.engines.scatter_async(RolloutActor.generate_timed, shards, sampling, after_loads)
        else:
            timed = False
            shards = split_evenly(prompt_ids, self.policy.size)
            refs = self.policy.scatter_async(PolicyActor.generate_batch, shards, sampling)

        def finish(results: list) -> Generation:
            out: list[Completion] = []
            spans = [(start, end) for _, start, end in results] if timed else []
            offset = 0
            for shard, result in zip(shards, results):
                for c in result[0] if timed else result:  # each actor numbered its own prompts from 0
                    c.prompt_index += offset
                    out.append(c)
                offset += len(shard)
            busy = (min(s for s, _ in spans), max(e for _, e in spans)) if spans else None
            after_push = None if after_loads is None else share_after_push(out, after_loads)
            return Generation(out, busy, tokens_after_push=after_push)

        return RayPending(refs, finish)

    def policy_logprobs(self, samples: list[RolloutSample]) -> list[list[float]]:
        return concat(self.policy.scatter(PolicyActor.logprobs, split_evenly(samples, self.policy.size)))

    def reference_logprobs(self, samples: list[RolloutSample]) -> list[list[float]]:
        return concat(self.policy.scatter(PolicyActor.reference_logprobs, split_evenly(samples, self.policy.size)))

    def update(self, samples: list[RolloutSample], normalizer: float) -> dict[str, float]:
        reports = self.policy.scatter(PolicyActor.update, split_evenly(samples, self.policy.size), normalizer)
        return _merge_reports(reports)

    def sync_weights(self) -> dict[str, float]:
        return self.push_weights().result()

    def push_weights(self) -> RayPending:
        """Rank 0 exports the weights (the object store's blob, or the collective push's plan with
        its buckets broadcast behind it; never through the driver) and every engine loads them, each
        as its next call; neither transport is waited for here."""
        if self.engines is None:  # HF generate samples from the trained weights themselves
            return RayPending([], lambda _: {})
        if isinstance(self.weight_sync, CollectiveSync):
            export = PolicyActor.send_weights
        elif self.weight_sync.payload == "adapter":
            export = PolicyActor.export_adapter
        else:
            export = PolicyActor.export_weights
        blob = self._rank0_of_all(self.policy, export)  # stays in the object store
        loads = self.weight_sync.start(blob, self.engines.actors)
        return RayPending(loads, lambda seconds: {"time/sync_load": max(seconds, default=0.0)})

    def critic_values(self, samples: list[RolloutSample]) -> list[list[float]]:
        return concat(self.critic.scatter(CriticActor.values, split_evenly(samples, self.critic.size)))

    def critic_update(self, samples: list[RolloutSample], normalizer: float) -> dict[str, float]:
        reports = self.critic.scatter(CriticActor.update, split_evenly(samples, self.critic.size), normalizer)
        return _merge_reports(reports)

    def reward_scores(self, samples: list[RolloutSample]) -> list[float]:
        return concat(self.reward.scatter(RewardActor.scores, split_evenly(samples, self.reward.size)))

    def save(self, output_dir: str) -> None:
        gather([self._rank0_of_all(self.policy, PolicyActor.save, output_dir)])
        if self.critic is not None:
            gather([self._rank0_of_all(self.critic, CriticActor.save, output_dir)])

    def _rank0_of_all(self, group: ActorGroup, method, *args):
        """Rank 0's call (an ObjectRef): on rank 0 alone, or under ZeRO-3 with several ranks, where
        gathering the shards is a collective, on every rank (the others' answers are dropped)."""
        if group.name not in self._all_ranks:
            self._all_ranks[group.name] = group.size > 1 and group.call_rank0(group.worker_cls.exports_need_all_ranks)
        if not self._all_ranks[group.name]:
            return group.call_rank0_async(method, *args)
        return group.call_all_async(method, *args)[0]

    def save_checkpoint(self, folder: str) -> None:
        """Each learning role's ranks write their part at once (policy/ and critic/ inside folder)."""
        refs = self.policy.call_all_async(PolicyActor.save_checkpoint, os.path.join(folder, "policy"))
        if self.critic is not None:
            refs += self.critic.call_all_async(CriticActor.save_checkpoint, os.path.join(folder, "critic"))
        gather(refs)

    def load_checkpoint(self, folder: str) -> None:
        refs = self.policy.call_all_async(PolicyActor.load_checkpoint, os.path.join(folder, "policy"))
        if self.critic is not None:
            refs += self.critic.call_all_async(CriticActor.load_checkpoint, os.path.join(folder, "critic"))
        gather(refs)


def share_after_push(completions: list[Completion], loads: int) -> float:
    """The share of the completions' tokens sampled after an in-flight push (a load past ``loads``,
    the pushes sent before the batch)."""
    stamps = [v for c in completions for v in (c.versions or ())]
    return sum(v > loads for v in stamps) / len(stamps) if stamps else 0.0


def _merge_reports(reports: list[dict]) -> dict[str, float]:
    """One update's metrics over the ranks: loss as the ranks' mean (each reports its share of
    the whole batch's loss times the world size); maxima as the largest; the rest weighted by each
    rank's samples."""
    total = sum(r.get("num_samples", 0) for r in reports) or 1
    merged: dict[str, float] = {"loss": sum(r["loss"] for r in reports) / len(reports)}
    for key in reports[0]:
        if key in ("loss", "num_samples") or reports[0][key] is None:
            continue
        if key in ("lr", "grad_norm"):  # the same on every rank after DDP's all-reduce
            merged[key] = reports[0][key]
        elif key.endswith("_max"):
            merged[key] = max(r[key] for r in reports)
        else:
            merged[key] = sum(r[key] * r.get("num_samples", 0) for r in reports) / total
    return merged

