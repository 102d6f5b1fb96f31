"""Joining a Ray cluster, or starting a local one, the same way for every entry point."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import ray
from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR

from fabric.ray_args import RayArguments

logger = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Ray Train V2 makes every ray.train.report() (each checkpoint, and the run's end) wait for the
# controller's health-check tick, 2 s by default: with a checkpoint every few steps that dominates
# small runs. Each tick also wakes the controller and the worker's main thread, which take cores
# and the GIL from the training step (at 0.1 s, 2-11% of a compute-bound step on 2 cores in
# benchmarks/README.md, "Ray's background work"); 0.5 s wakes it a fifth as often.
WORKER_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # Ray Train replaces print() in its workers with one that logs every call at INFO and, when
    # sys.stdout is swapped out (contextlib.redirect_stdout, dill's capture), also prints it: so
    # captured text leaks to the log and library prints (trainer.log_metrics) come out twice.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def connect(ray_args: RayArguments, extra_cpus: float = 0) -> dict:
    """Connect to ``ray_address`` / ``RAY_ADDRESS`` or start a local Ray; return its resources.
    ``extra_cpus``: what a local Ray must hold besides the workers (e.g. RL rollout engines)."""
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)  # the Train controller reads it in this process
    if not ray.is_initialized():
        address = ray_args.resolved_address()
        kwargs = dict(ray_args.ray_init_kwargs or {})
        runtime_env = kwargs.pop("runtime_env", {}) or {}
        env_vars = {**WORKER_ENV, **runtime_env.get("env_vars", {})}
        if address is None:
            # Local: workers import our packages from this checkout even when it is not installed.
            env_vars.setdefault("PYTHONPATH", _REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            kwargs.setdefault("num_cpus", local_cpu_count(ray_args, extra_cpus))
            kwargs.setdefault("include_dashboard", False)
            # Ray gives its Train controller actor this switch, and so every actor the controller
            # starts: a streamed run's DatasetManager, an async actor whose shutdown ray.get()s.
            # On this Ray the controller runs in the driver (controller_in_driver.py), so the job passes
            # it on ("0", Ray Train's value; importing its constant would import Ray Train here).
            env_vars.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, "0")
            # Ray starts workers at nice 15, below its own daemons and this driver; a spinning
            # OpenMP thread of a training worker then stalls whenever one of them wakes (a 9M
            # model trained 18.1 -> 19.3 examples/s with nice 0, measured in benchmarks/README.md).
            # This Ray is the run's own, so its workers are what the machine is for.
            # It does not prestart a worker per CPU for the first driver either: those start without the
            # job's runtime_env (below), so no task or actor of the run can use them; they only
            # take ~1 CPU-second each while the run starts.
            kwargs["_system_config"] = {"worker_niceness": 0, "prestart_worker_first_driver": False,
                                        **(kwargs.get("_system_config") or {})}
            if not kwargs["include_dashboard"]:
                runtime_env.setdefault("worker_process_setup_hook", quiet_state_api_pollers)
            # "local" always starts a fresh Ray. Without it, ray.init() joins whatever cluster
            # /tmp/ray/ray_current_cluster names, a file a stopped `ray start` or test cluster
            # leaves behind, and then refuses num_cpus.
            address = "local"
            # No node of this Ray is ever drained, so Ray Train's preemption watcher (an actor, a
            # process importing Ray Train: ~3.5 CPU-seconds at start-up) has nothing to watch. The
            # controller reads the switch from this process's environment.
            os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        runtime_env["env_vars"] = env_vars
        # Every worker's and actor's output comes to this process's stdout/stderr: the CLI sends
        # those to the run's log file (cluster/console.py), so nothing a worker says is lost.
        with contextlib.ExitStack() as local_start:
            if address == "local":
                local_start.enter_context(_registration_polled_often())
                if not kwargs["include_dashboard"]:
                    local_start.enter_context(_no_dashboard_process())
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True, **kwargs)
        _session["started_local"] = ray.get_runtime_context().gcs_address if address == "local" else None
    quiet_ray_data()
    resources = ray.cluster_resources()
    logger.debug("Ray resources: %s", {k: v for k, v in resources.items() if not k.startswith("node:")})
    return resources


@contextlib.contextmanager
def _registration_polled_often():
    """``ray.init()`` of a new local Ray, without up to 2 s of sleeping.

    Having started the raylet, ray.init waits 0.1 s and asks the GCS for the new node; until the
    raylet has registered, Ray's C++ lookup (GlobalStateAccessor::GetNode, Ray 2.60) sleeps a fixed
    second between asks. Registering takes 0.6 or 1.5 s here, so ray.init took 2.1 or 3.1 s, in
    whole-second steps. Ray's lookup runs as before, only once the node is there.
    """
    services = ray._private.services
    lookup = getattr(services, "get_node", None)
    if lookup is None:  # another Ray: its own way
        yield
        return

    def get_node(gcs_address, node_id):
        wait_for_node(gcs_address, node_id)
        return lookup(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = lookup


@contextlib.contextmanager
def _no_dashboard_process():
    """``ray.init()`` of a new local Ray without its dashboard, without the dashboard's process.

    With ``include_dashboard=False`` Ray still starts the dashboard's head process, serving only
    its usage-stats module (which reports to Ray's servers), and ray.init waits for that process
    to register: 1.3-1.5 s of ray.init here (2.6-2.8 -> 1.2-1.35 s) and a Python process that
    imports Ray's dashboard beside the driver. Nothing a run does talks to it: the State API and
    job submission need the full dashboard, which this Ray does not have either way. The node
    records the same empty dashboard URL Ray gives a Ray without a dashboard.
    """
    node_class = getattr(getattr(ray._private, "node", None), "Node", None)
    start = getattr(node_class, "start_api_server", None)
    if start is None:  # another Ray: its own way
        yield
        return

    def start_no_api_server(node, *, include_dashboard, raise_on_failure):
        node._webui_url = ""

    node_class.start_api_server = start_no_api_server
    try:
        yield
    finally:
        node_class.start_api_server = start


def wait_for_node(gcs_address: str, node_id: str, timeout_s: float = 30, interval_s: float = 0.1) -> bool:
    """Whether the node ``node_id`` (hex) registered with the GCS at ``gcs_address`` as alive
    within ``timeout_s``, asked every ``interval_s`` (every 0.02 s was slower on 2 cores: the
    asking took CPU from the daemons still starting)."""
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    client = GcsClient(address=gcs_address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            nodes = client.get_all_node_info(timeout=1)
        except Exception:  # noqa: BLE001 - not answering yet; Ray's own lookup reports a GCS that never does
            nodes = {}
        if any(key.hex() == node_id and info.state == GcsNodeInfo.ALIVE for key, info in nodes.items()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def shutdown() -> None:
    """``ray.shutdown()``, a second sooner for a local Ray this process started.

    Ray stops its processes in order, each with a second's grace before SIGKILL: raylet, GCS, then
    the autoscaler monitor, which on SIGTERM tries to tell the already-stopped GCS that it died and
    so always uses its whole second. On a local Ray it scales nothing and holds nothing, so it is
    killed first (measured: ray.shutdown 1.4 -> 0.4 s).
    """
    if started_local_ray():
        node = getattr(ray._private.worker, "_global_node", None)  # where ray.init keeps its processes
        monitors = (getattr(node, "all_processes", None) or {}).get(ray._private.ray_constants.PROCESS_TYPE_MONITOR, [])
        for info in monitors:
            if info.process.poll() is None:
                info.process.kill()
                info.process.wait()
    ray.shutdown()


def started_local_ray() -> bool:
    """Whether this process started the local Ray it is connected to (it ends with this process)."""
    return ray.is_initialized() and _session["started_local"] == ray.get_runtime_context().gcs_address


_session = {"started_local": None}  # the GCS address of the local Ray connect() started


def quiet_state_api_pollers() -> None:
    """The worker_process_setup_hook of a local Ray started without its dashboard.

    Ray Train's PlacementGroupCleaner asks the State API, which the dashboard serves, every second
    whether the Train controller still lives, and logs a warning each time it gets no answer. Here
    it never can; and the placement groups it guards end with the local Ray this driver owns.
    """
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)


def local_cpu_count(ray_args: RayArguments, extra_cpus: float = 0) -> int:
    """Logical CPUs for a local Ray: enough for every worker plus one for data and the controller.

    Declaring more CPUs than the machine has only oversubscribes threads; declaring fewer leaves a
    2-core machine unable to place two workers and a Ray Data task at once (the run would hang).
    """
    if ray_args.ray_num_cpus:
        return int(ray_args.ray_num_cpus)
    per_worker = float(ray_args.resources_per_worker.get("CPU", 1) or 0)
    needed = int(per_worker * ray_args.ray_num_workers + extra_cpus + 0.999) + 1
    return max(os.cpu_count() or 1, needed)


def quiet_ray_data() -> None:
    """Ray Data's progress bars redraw many times a second in captured logs; periodic lines suffice."""
    ray.data.DataContext.get_current().enable_progress_bars = False
