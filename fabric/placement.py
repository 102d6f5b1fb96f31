"""Where an RL run's roles live: one explicit placement group per role, checked before it is made.

Each role (policy, rollout, critic, reward, reference) asks for ``num_actors`` actors of
``resources`` each. A role that is not colocated owns a placement group with one bundle per
actor; a colocated role (``colocate_with="policy"``) puts its actors on the host role's bundles
and the bundle's resources are split between everyone sitting on it (OpenRLHF shares GPUs the
same way, with 0.x fractions), so the group reserves nothing twice and every actor fits.

Ray leaves an infeasible placement group pending forever (it hopes an autoscaler adds nodes);
so the request is checked against the live cluster first and ``pg.ready()`` is awaited with a
timeout: a run that cannot be placed fails in seconds, with a message that says what is missing.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from registries.errors import UserError

from fabric.ray_args import PLACEMENT_STRATEGIES

# Ray stores resource amounts as fixed point with 4 decimals; a share is rounded *down* to that,
# or three actors asking 0.33333 would round up to 0.3334 each and overflow their bundle.
_RESOURCE_UNIT = 10_000
# Actor options take these as keywords; Ray refuses them inside ``resources``.
_KEYWORD_RESOURCES = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


class PlacementError(UserError):
    """The roles asked for resources the cluster does not have (or does not have free)."""


@dataclass(frozen=True)
class RoleSpec:
    """One role as the config describes it. ``resources`` is what each actor needs: for a host role
    its bundle; for a colocated role only its keys count (which of the host's resources it shares);
    ``{}`` shares all of them. The ``*_key`` names, when given, are the config keys an error tells
    the user to change."""

    name: str
    num_actors: int
    resources: dict[str, float]
    colocate_with: str | None = None
    num_actors_key: str | None = field(default=None, compare=False)
    resources_key: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_actors < 1:
            raise PlacementError(f"role {self.name}: num_actors must be at least 1, got {self.num_actors}. "
                                 f"Set {self._count_hint()} to 1 or more, or leave the role out.")
        for key, amount in self.resources.items():
            if key.upper() in ("CPU", "GPU") and key != key.upper():
                raise PlacementError(f"role {self.name}: resources name {key!r}; Ray's resource names are "
                                     f"case-sensitive, so no node would have it. Write {key.upper()!r}.")
            if amount < 0:
                raise PlacementError(f"role {self.name}: resources[{key!r}] is {amount}; it cannot be negative.")
        if self.colocate_with is None and not any(self.resources.values()):
            raise PlacementError(
                f"role {self.name}: each actor needs some resource (e.g. {{CPU: 1}} or {{GPU: 1}}); got "
                f"{fmt_resources(self.resources)}. Set {self._resources_hint()}, or colocate the role with another."
            )

    def _count_hint(self) -> str:
        return self.num_actors_key or f"the number of {self.name} actors"

    def _resources_hint(self) -> str:
        return self.resources_key or f"{self.name}'s resources per actor"


@dataclass
class RolePlacement:
    """A placed role: its (possibly shared) placement group, the bundle of each actor, and what each
    actor asks from its bundle (the same for every actor of the role)."""

    role: str
    placement_group: PlacementGroup
    bundle_indices: list[int]
    actor_resources: dict[str, float]
    host: str  # the role that owns the placement group (itself unless colocated)

    @property
    def num_actors(self) -> int:
        return len(self.bundle_indices)

    def scheduling(self, i: int) -> dict:
        """``.options(**placement.scheduling(i))`` for actor ``i``: its bundle and its resources.

        num_cpus and num_gpus are always given: left out, an actor asks 1 CPU to be created, and
        Ray refuses it outright on a bundle without CPU (a {GPU: 1} or custom-resource-only one).
        """
        options: dict = {"num_cpus": 0, "num_gpus": 0, "resources": {}}
        for key, amount in self.actor_resources.items():
            if key in _KEYWORD_RESOURCES:
                options[_KEYWORD_RESOURCES[key]] = amount
            else:
                options["resources"][key] = amount
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=self.bundle_indices[i]
        )
        return options


def place_roles(roles: list[RoleSpec], strategy: str = "PACK", timeout_s: float = 60) -> dict[str, RolePlacement]:
    """Check ``roles`` against the live cluster, create one placement group per host role, and wait
    until all are placed; a PlacementError (and nothing left reserved) when they cannot be."""
    if strategy not in PLACEMENT_STRATEGIES:
        raise PlacementError(f"placement strategy {strategy!r} is not one of {', '.join(PLACEMENT_STRATEGIES)}.")
    _check_names(roles)
    hosts = [r for r in roles if r.colocate_with is None]
    _check_feasible(hosts, strategy, _alive_nodes())
    guests = {h.name: [r for r in roles if r.colocate_with == h.name] for h in hosts}
    shares = {name: share for h in hosts for name, share in _split_bundle(h, guests[h.name]).items()}

    groups: dict[str, PlacementGroup] = {}
    try:  # whatever stops us (timeout, Ctrl-C) leaves nothing reserved
        for h in hosts:
            groups[h.name] = placement_group([_bundle(h) for _ in range(h.num_actors)], strategy=strategy)
        waits = {h.name: groups[h.name].ready() for h in hosts}
        ready, _ = ray.wait(list(waits.values()), num_returns=len(waits), timeout=timeout_s)
        if len(ready) < len(waits):
            free = ray.available_resources()  # before the removal gives ours back
            _raise_not_ready([h for h in hosts if waits[h.name] not in ready], strategy, timeout_s, free)
    except BaseException:
        _remove(groups.values())
        raise

    placements = {}
    for host in hosts:
        for role in [host, *guests[host.name]]:
            placements[role.name] = RolePlacement(
                role=role.name, placement_group=groups[host.name],
                bundle_indices=[i % host.num_actors for i in range(role.num_actors)],
                actor_resources=shares[role.name], host=host.name,
            )
    return {r.name: placements[r.name] for r in roles}


def release(placements: dict[str, RolePlacement]) -> None:
    """Remove the placement groups (each once, shared ones too); actors on them are killed by Ray."""
    _remove({id(p.placement_group): p.placement_group for p in placements.values()}.values())


def _remove(groups) -> None:
    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or Ray already shut down: nothing is held either way
            pass


def fmt_resources(resources: dict[str, float]) -> str:
    """``{CPU: 1, rollout_node: 0.5}``: the YAML a user wrote, not Python's quoted dict."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _check_names(roles: list[RoleSpec]) -> None:
    names = Counter(r.name for r in roles)
    if dup := [n for n, c in names.items() if c > 1]:
        raise PlacementError(f"role {dup[0]} is listed {names[dup[0]]} times; each role needs one entry.")
    by_name = {r.name: r for r in roles}
    for role in roles:
        target = role.colocate_with
        if target is None:
            continue
        if target not in by_name:
            raise PlacementError(f"role {role.name} is colocated with {target!r}, which is not a role of this run "
                                 f"(roles: {', '.join(by_name)}). Colocate it with one of them, or not at all.")
        if target == role.name:
            raise PlacementError(f"role {role.name} is colocated with itself; remove its colocate_with.")
        host = by_name[target]
        if host.colocate_with is not None:  # also catches cycles: a -> b -> a has a guest as host
            raise PlacementError(
                f"role {role.name} is colocated with {target}, which is itself colocated with {host.colocate_with}; "
                f"colocation does not chain. Colocate {role.name} with {host.colocate_with} directly."
            )
        extra = [k for k, v in role.resources.items() if v and not host.resources.get(k)]
        if extra:
            raise PlacementError(
                f"role {role.name} is colocated with {target} and asks for {', '.join(extra)}, which {target}'s "
                f"actors do not reserve ({fmt_resources(host.resources)}). Add it to {host._resources_hint()}, "
                f"or do not colocate {role.name}."
            )


def _split_bundle(host: RoleSpec, guests: list[RoleSpec]) -> dict[str, dict[str, float]]:
    """Each role's request per actor: every resource of the bundle divided equally between the
    actors that use it on its most crowded bundle, so all of them fit on every bundle."""
    sharing = [host, *guests]
    shares: dict[str, dict[str, float]] = {r.name: {} for r in sharing}
    for key, amount in host.resources.items():
        if not amount:
            continue
        users = [r for r in sharing if r is host or not r.resources or r.resources.get(key)]
        crowd = max(sum(len(range(b, r.num_actors, host.num_actors)) for r in users) for b in range(host.num_actors))
        share = math.floor(amount / crowd * _RESOURCE_UNIT + 1e-6) / _RESOURCE_UNIT  # 0.3 / 3 is 0.0999...
        if share <= 0:
            raise PlacementError(f"role {host.name}: {crowd} actors share one bundle's {key}: {amount:g}, too little "
                                 f"to split. Raise {host._resources_hint()} or colocate fewer actors.")
        for role in users:
            shares[role.name][key] = share
    return shares


def _bundle(role: RoleSpec) -> dict[str, float]:
    return {k: v for k, v in role.resources.items() if v}  # Ray refuses some zero entries (all-zero bundles)


def _alive_nodes() -> list[dict[str, float]]:
    if not ray.is_initialized():
        raise RuntimeError("place_roles needs Ray: call fabric.ray_session.connect() first.")
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _check_feasible(hosts: list[RoleSpec], strategy: str, nodes: list[dict[str, float]]) -> None:
    """Raise for a request no free-of-other-work cluster of these nodes could satisfy."""
    total: Counter = Counter()
    for node in nodes:
        total.update(node)
    for role in hosts:
        asks = {k: v for k, v in role.resources.items() if v}
        for key, amount in asks.items():
            if role.num_actors * amount > total[key] + 1e-9:
                raise PlacementError(
                    f"role {role.name}: {_ask(role)} need {role.num_actors * amount:g} {key}; the cluster has "
                    f"{total[key]:g} {key}. {_fix(role, f'add {key} nodes')}"
                )
        fitting = [n for n in nodes if all(n.get(k, 0) + 1e-9 >= v for k, v in asks.items())]
        if not fitting:
            raise PlacementError(
                f"role {role.name}: one actor asks for {fmt_resources(asks)}, but no single node has that much "
                f"(nodes: {_fmt_nodes(nodes, asks)}). {_fix(role, 'add a node that large')}"
            )
        if strategy == "STRICT_PACK":
            whole = {k: v * role.num_actors for k, v in asks.items()}
            if not any(all(n.get(k, 0) + 1e-9 >= v for k, v in whole.items()) for n in nodes):
                raise PlacementError(
                    f"role {role.name}: STRICT_PACK puts all {_ask(role)} on one node, {fmt_resources(whole)}, "
                    f"but no node has that much (nodes: {_fmt_nodes(nodes, asks)}). "
                    f"{_fix(role, 'use placement_strategy PACK')}"
                )
        if strategy == "STRICT_SPREAD" and len(fitting) < role.num_actors:
            raise PlacementError(
                f"role {role.name}: STRICT_SPREAD puts each of {_ask(role)} on its own node, but only "
                f"{len(fitting)} node(s) can hold one. {_fix(role, 'use placement_strategy SPREAD')}"
            )
    # Each role may fit alone and still not all together.
    needed: Counter = Counter()
    for role in hosts:
        needed.update({k: v * role.num_actors for k, v in role.resources.items() if v})
    for key, amount in needed.items():
        if amount > total[key] + 1e-9:
            users = [r for r in hosts if r.resources.get(key)]
            raise PlacementError(
                f"roles {', '.join(r.name for r in users)} together need {amount:g} {key} "
                f"({'; '.join(f'{r.name}: {_ask(r)}' for r in users)}); the cluster has {total[key]:g} {key}. "
                f"Give some role fewer actors or less {key}, colocate roles (e.g. the reference with the "
                f"policy), or add {key} nodes."
            )


def _raise_not_ready(waiting: list[RoleSpec], strategy: str, timeout_s: float, free: dict) -> None:
    asks = "; ".join(f"{h.name}: {_ask(h)}" for h in waiting)
    raise PlacementError(
        f"the cluster could not place {asks} ({strategy}) within {timeout_s:g} s, though it has these resources "
        f"in total: other actors or placement groups hold them now (free: "
        f"{fmt_resources({k: v for k, v in free.items() if not k.startswith('node:')})}). Stop the other work, "
        f"give the roles fewer actors or resources, or add nodes."
    )


def _ask(role: RoleSpec) -> str:
    return f"{role.num_actors} actor{'s' if role.num_actors > 1 else ''} x {fmt_resources(role.resources)}"


def _fix(role: RoleSpec, last: str) -> str:
    return f"Lower {role._count_hint()}, change {role._resources_hint()}, or {last}."


def _fmt_nodes(nodes: list[dict[str, float]], asks: dict[str, float]) -> str:
    return ", ".join(fmt_resources({k: n.get(k, 0) for k in asks}) for n in nodes)
