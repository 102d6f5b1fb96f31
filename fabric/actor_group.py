"""A role's actors as one typed group: spawned on their bundles, called by method, ranked.

The controller of an RL stage talks to a role through its ``ActorGroup``. Calls name the method
itself (``group.call_all(PolicyWorker.logprobs, batch)``), not a string, so a rename is caught by
the type checker and a typo fails here, before any actor runs. Results come back in rank order.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable, Concatenate, Generic, ParamSpec, TypeVar

import ray
from ray.exceptions import RayTaskError

from registries.errors import UserError, find_user_error
from stages.rl.controller.shards import concat, split_evenly  # noqa: F401  (re-exported: the groups' way to shard work)

from .placement import RolePlacement

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T")


class RoleWorker:
    """Base class of a role's actors. ``rank`` and ``world_size`` are plain attributes, set before
    the subclass's ``__init__`` runs: the group gives each actor RANK and WORLD_SIZE in its
    environment (torch's own names), read here so no subclass has to call ``super().__init__``."""

    rank: int
    world_size: int

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        return self

    def address_and_free_port(self) -> tuple[str, int]:
        """This node's IP and a port free on it now, for rank 0 to host the process group's store."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
        timeout_s: float = 300,
    ) -> None:
        """Join the role's torch.distributed group. The env vars let libraries that read them
        (transformers, DeepSpeed) find the same group."""
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size))
        self.rank, self.world_size = rank, world_size
        if backend == "nccl" and torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES leaves this actor its own GPU(s) only
        dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def set_threads(self, requested: int | None, whole_node: bool) -> int:
        """torch's intra-op threads in this actor (fabric/threads.py's rule); returns the count."""
        from .threads import set_torch_threads

        return set_torch_threads(requested, whole_node)


W = TypeVar("W", bound=RoleWorker)


class ActorGroup(Generic[W]):
    """``placement.num_actors`` actors of ``worker_cls``, actor i (rank i) on its bundle; each is
    built with ``worker_cls(*init_args, **init_kwargs)``, and the constructor blocks until all are
    up, so a failing ``__init__`` is raised here rather than at the first call. ``class_options``:
    the actor class's own Ray options (``ray.remote``'s, e.g. ``concurrency_groups``)."""

    def __init__(self, worker_cls: type[W], placement: RolePlacement, *init_args: Any,
                 env_vars: dict[str, str] | None = None, name: str | None = None,
                 class_options: dict[str, Any] | None = None, **init_kwargs: Any):
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, RoleWorker)):
            raise TypeError(f"ActorGroup needs a RoleWorker subclass, got {worker_cls!r}.")
        self.worker_cls = worker_cls
        self.placement = placement
        self.name = name or placement.role
        guarded = _guarded(worker_cls)
        remote_cls = ray.remote(**class_options)(guarded) if class_options else ray.remote(guarded)
        size = placement.num_actors
        self.actors: list[ray.actor.ActorHandle] = []
        for rank in range(size):
            env = {**(env_vars or {}), "RANK": str(rank), "WORLD_SIZE": str(size)}
            options = {**placement.scheduling(rank), "runtime_env": {"env_vars": env}}
            self.actors.append(remote_cls.options(**options).remote(*init_args, **init_kwargs))
        try:
            gather([actor._rayfactory_ready.remote() for actor in self.actors])
        except BaseException:
            self.kill()
            raise

    @property
    def size(self) -> int:
        return len(self.actors)

    def __repr__(self) -> str:
        return f"ActorGroup({self.name}: {self.size} x {self.worker_cls.__name__})"

    # --- calls -----------------------------------------------------------------------------------
    def call_all_async(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list:
        """One call per actor with the same arguments (stored once, not once per actor)."""
        name = self._resolve(method)
        if self.size > 1:
            args = tuple(_shared(a) for a in args)
            kwargs = {k: _shared(v) for k, v in kwargs.items()}
        return [getattr(actor, name).remote(*args, **kwargs) for actor in self.actors]

    def call_all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return gather(self.call_all_async(method, *args, **kwargs))

    def call_rank0_async(self, method: Callable[Concatenate[W, P], R], *args: P.args,
                         **kwargs: P.kwargs) -> ray.ObjectRef:
        return getattr(self.actors[0], self._resolve(method)).remote(*args, **kwargs)

    def call_rank0(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return gather(self.call_rank0_async(method, *args, **kwargs))

    def scatter_async(self, method: Callable[Concatenate[W, S, P], R], shards: list[S], *common_args: P.args,
                      **kwargs: P.kwargs) -> list:
        """Shard i to rank i as the first argument, then the arguments common to all."""
        name = self._resolve(method)
        if len(shards) != self.size:
            raise ValueError(f"{self.name}: scatter got {len(shards)} shards for {self.size} actors; "
                             "split the data with split_evenly(items, group.size).")
        if self.size > 1:
            common_args = tuple(_shared(a) for a in common_args)
            kwargs = {k: _shared(v) for k, v in kwargs.items()}
        return [getattr(actor, name).remote(shard, *common_args, **kwargs) for actor, shard in zip(self.actors, shards)]

    def scatter(self, method: Callable[Concatenate[W, S, P], R], shards: list[S], *common_args: P.args,
                **kwargs: P.kwargs) -> list[R]:
        return gather(self.scatter_async(method, shards, *common_args, **kwargs))

    def _resolve(self, method: Callable) -> str:
        """The actor method's name, after checking ``method`` is one of ``worker_cls``'s own."""
        if isinstance(method, str):
            raise TypeError(f"{self.name}: pass the method itself (e.g. {self.worker_cls.__name__}.{method}), "
                            f"not its name {method!r}.")
        func = getattr(method, "__func__", method)  # a bound method or classmethod: its function
        name = getattr(func, "__name__", None)
        for klass in self.worker_cls.__mro__:
            found = vars(klass).get(name) if name else None
            if found is not None and getattr(found, "__func__", found) is func:
                return name
        owner = getattr(func, "__qualname__", repr(method))
        raise TypeError(f"{self.name}: {owner} is not a method of {self.worker_cls.__name__}, the class of this "
                        f"group's actors; call it on the group whose workers define it.")

    # --- the group as a whole --------------------------------------------------------------------
    def init_process_group(self, backend: str = "gloo", timeout_s: float = 300) -> None:
        """Make the actors one torch.distributed group (rank = index); returns when all have joined."""
        addr, port = self.call_rank0(RoleWorker.address_and_free_port)
        gather([actor.init_process_group.remote(addr, port, rank, self.size, backend, timeout_s)
                for rank, actor in enumerate(self.actors)])

    def node_ids(self) -> list[str]:
        return self.call_all(RoleWorker.node_id)

    def kill(self) -> None:
        """End the actors now (their bundles stay reserved until the placement is released)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def _guarded(worker_cls: type[W]) -> type[W]:
    """``worker_cls`` whose ``__init__`` keeps a UserError to raise from its first call.

    Ray reports an exception in an actor's ``__init__`` as ActorDiedError carrying only text; an
    exception in a method keeps its type (``RayTaskError.cause``), which ``gather`` unwraps.
    """

    class Guarded(worker_cls):  # type: ignore[valid-type, misc]
        def __init__(self, *args, **kwargs):
            self._rayfactory_init_error = None
            try:
                super().__init__(*args, **kwargs)
            except UserError as exc:
                self._rayfactory_init_error = exc

        def _rayfactory_ready(self) -> None:
            if self._rayfactory_init_error is not None:
                raise self._rayfactory_init_error

    # Ray names the actor after its class (logs, `ray list actors`).
    Guarded.__name__, Guarded.__qualname__ = worker_cls.__name__, worker_cls.__qualname__
    return Guarded


class RayPending:
    """Calls already sent to actors, waited for later: ``result()`` gathers them (a failure raised
    as ``gather`` raises it) and hands the results to ``finish``; ``done()`` never blocks."""

    def __init__(self, refs: list, finish: Callable[[list], Any] = lambda results: results):
        self.refs, self.finish = list(refs), finish

    def done(self) -> bool:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self):
        return self.finish(gather(self.refs) if self.refs else [])


def gather(refs, timeout: float | None = None):
    """``ray.get``, except that a UserError raised in an actor is raised here as itself (so the CLI
    prints its message); Ray's wrapper, with the remote traceback, is kept as its ``__cause__``."""
    try:
        if isinstance(refs, list) and len(refs) > 1:
            _fail_fast(refs, timeout)
        return ray.get(refs, timeout=timeout)
    except RayTaskError as exc:
        user_error = find_user_error(exc)
        if user_error is not None and user_error is not exc:
            raise user_error from exc
        raise


def _fail_fast(refs: list, timeout: float | None) -> None:
    """Wait for the calls one at a time as they finish, raising the first failure at once: when
    one rank of a process group dies, the others block in a collective until its timeout, and
    ``ray.get`` of the whole list would wait for them first."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:  # timed out: the caller's ray.get raises GetTimeoutError
            return
        ray.get(ready[0])


def _shared(value):
    """A value sent to every actor goes into the object store once; Ray hands each actor the value."""
    return value if isinstance(value, ray.ObjectRef) else ray.put(value)
