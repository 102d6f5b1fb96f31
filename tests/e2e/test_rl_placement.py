"""RL roles on a simulated 3-node cluster: each role on the nodes its resources name, colocation on
shared bundles, impossible requests refused in seconds, a gloo group, typed calls in rank order.

One ``ray.cluster_utils.Cluster`` for the module: a head with 1 CPU, node A with {CPU: 2,
policy_node: 2}, node B with {CPU: 2, rollout_node: 2}. The roles are placed once and every test
looks at the same groups.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
import ray
import ray.cloudpickle
from ray.cluster_utils import Cluster

from fabric.actor_group import ActorGroup, RoleWorker, concat, split_evenly
from fabric.ray_args import RayArguments
from fabric.placement import PlacementError, RoleSpec, place_roles, release
from fabric.ray_session import connect
from registries.errors import ArgumentError

# The actors' classes live in this module, which the actors cannot import by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Echo(RoleWorker):
    def __init__(self, tag: str = "echo", fail_with: str | None = None):
        if fail_with:
            raise ArgumentError("model_name_or_path", fail_with)
        self.tag = tag

    def whoami(self) -> tuple[str, int, int]:
        return self.tag, self.rank, self.world_size

    def plus(self, shard: list[int], offset: int = 0) -> list[int]:
        return [x + offset for x in shard]

    def all_reduce_rank(self) -> float:
        import torch
        import torch.distributed as dist

        value = torch.tensor([self.rank + 1.0])
        dist.all_reduce(value)
        return value.item()

    def reject(self, message: str) -> None:
        raise ArgumentError("learning_rate", message)


class Stranger:
    def whoami(self) -> None: ...


@pytest.fixture(scope="module")
def cluster():
    """The module's own multi-node Ray, with the session's local Ray put back afterwards.

    A driver talks to one Ray at a time, so a local Ray started by the session-wide ``ray_session``
    fixture is shut down first. That fixture's value is cached for the session: tests after this
    module would get no Ray at all, so the same local Ray is started again on teardown (~6 s, only
    when there was one). Running the module in a subprocess would isolate it as well, but would
    hide its tests from pytest's report; restoring is simple and nothing in it is stateful.
    """
    restore = ray.is_initialized()
    if restore:
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})  # -4 s
    try:
        node_a = nodes.add_node(num_cpus=2, resources={"policy_node": 2})
        node_b = nodes.add_node(num_cpus=2, resources={"rollout_node": 2})
        # The actors import fabric from this checkout, installed or not.
        ray.init(address=nodes.address, runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT}})
        nodes.wait_for_nodes()
        yield SimpleNamespace(a=node_a.node_id, b=node_b.node_id, head=nodes.head_node.node_id)
    finally:
        ray.shutdown()
        nodes.shutdown()
        if restore:
            connect(RayArguments(ray_num_cpus=4))


@pytest.fixture(scope="module")
def roles(cluster):
    """policy and rollout on their nodes, reference colocated with policy; placed once."""
    specs = [
        RoleSpec("policy", 2, {"CPU": 1, "policy_node": 1}),
        RoleSpec("rollout", 2, {"CPU": 1, "rollout_node": 1}),
        RoleSpec("reference", 2, {"CPU": 1}, colocate_with="policy"),
    ]
    placements = place_roles(specs, timeout_s=30)
    groups = {name: ActorGroup(Echo, placement, tag=name) for name, placement in placements.items()}
    yield SimpleNamespace(placements=placements, **groups)
    for group in groups.values():
        group.kill()
    release(placements)


def test_each_role_lands_on_the_node_with_its_resource(cluster, roles):
    assert roles.policy.node_ids() == [cluster.a, cluster.a]
    assert roles.rollout.node_ids() == [cluster.b, cluster.b]


def test_colocated_role_shares_the_hosts_bundles(cluster, roles):
    policy, reference = roles.placements["policy"], roles.placements["reference"]
    assert reference.placement_group == policy.placement_group
    assert reference.bundle_indices == policy.bundle_indices == [0, 1]
    # The bundle's CPU is split between the two actors on it; policy_node is policy's alone.
    assert policy.actor_resources == {"CPU": 0.5, "policy_node": 1}
    assert reference.actor_resources == {"CPU": 0.5}
    assert roles.reference.node_ids() == roles.policy.node_ids()


def test_typed_calls_come_back_in_rank_order(roles):
    group = roles.rollout
    assert group.call_all(Echo.whoami) == [("rollout", 0, 2), ("rollout", 1, 2)]
    assert group.call_rank0(Echo.whoami) == ("rollout", 0, 2)
    shards = split_evenly([1, 2, 3, 4, 5], group.size)
    assert shards == [[1, 2, 3], [4, 5]]
    assert concat(group.scatter(Echo.plus, shards, offset=10)) == [11, 12, 13, 14, 15]
    assert ray.get(group.call_all_async(Echo.plus, [1], 1)) == [[2], [2]]


def test_methods_of_another_class_or_names_are_refused(roles):
    with pytest.raises(TypeError, match="Stranger.whoami is not a method of Echo"):
        roles.policy.call_all(Stranger.whoami)
    with pytest.raises(TypeError, match="pass the method itself"):
        roles.policy.call_all("whoami")
    with pytest.raises(ValueError, match="3 shards for 2 actors"):
        roles.policy.scatter(Echo.plus, [[1], [2], [3]])


def test_user_errors_in_actors_arrive_as_themselves(roles):
    with pytest.raises(ArgumentError, match="learning_rate is too high") as caught:
        roles.rollout.call_rank0(Echo.reject, "learning_rate is too high")
    assert type(caught.value) is ArgumentError and caught.value.key == "learning_rate"
    # An __init__ that raises one: the group is not built, the same error arrives, the actors end.
    placement = place_roles([RoleSpec("judge", 1, {"CPU": 1})], timeout_s=30)
    try:
        with pytest.raises(ArgumentError, match="no such model"):
            ActorGroup(Echo, placement["judge"], fail_with="no such model")
    finally:
        release(placement)


def test_gloo_process_group_across_policy_actors(roles):
    roles.policy.init_process_group(backend="gloo")
    assert roles.policy.call_all(Echo.all_reduce_rank) == [3.0, 3.0]


@pytest.mark.parametrize(
    "spec, missing",
    [
        (RoleSpec("rollout", 2, {"GPU": 1}), "role rollout: 2 actors x {GPU: 1} need 2 GPU; the cluster has 0 GPU"),
        (RoleSpec("policy", 5, {"CPU": 1, "policy_node": 1}),
         "role policy: 5 actors x {CPU: 1, policy_node: 1} need 5 policy_node; the cluster has 2 policy_node"),
        (RoleSpec("critic", 1, {"CPU": 1, "policy_node": 1, "rollout_node": 1}),
         "role critic: one actor asks for {CPU: 1, policy_node: 1, rollout_node: 1}, but no single node"),
    ],
)
def test_impossible_placement_fails_at_once(cluster, spec, missing):
    start = time.monotonic()
    with pytest.raises(PlacementError) as caught:
        place_roles([spec], timeout_s=30)
    assert missing in str(caught.value)
    assert time.monotonic() - start < 5


def test_bad_colocation_is_refused(cluster):
    with pytest.raises(PlacementError, match="colocation does not chain"):
        place_roles([RoleSpec("a", 1, {"CPU": 1}), RoleSpec("b", 1, {}, colocate_with="a"),
                     RoleSpec("c", 1, {}, colocate_with="b")])
    with pytest.raises(PlacementError, match="'ghost', which is not a role"):
        place_roles([RoleSpec("a", 1, {"CPU": 1}, colocate_with="ghost")])
    with pytest.raises(PlacementError, match="asks for GPU, which a's actors do not reserve"):
        place_roles([RoleSpec("a", 1, {"CPU": 1}), RoleSpec("b", 1, {"GPU": 1}, colocate_with="a")])


def test_placement_held_by_others_times_out_and_reserves_nothing(cluster, roles):
    """The roles above hold all of policy_node: a feasible request waits, then fails, not hangs."""
    groups_before = _live_groups()
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"could not place critic: 1 actor x \{CPU: 1, policy_node: 1\}"):
        place_roles([RoleSpec("critic", 1, {"CPU": 1, "policy_node": 1})], timeout_s=2)
    assert time.monotonic() - start < 6
    deadline = time.monotonic() + 5  # removal is asynchronous
    while _live_groups() != groups_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_groups() == groups_before


def _live_groups() -> set[str]:
    return {pg_id for pg_id, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}
