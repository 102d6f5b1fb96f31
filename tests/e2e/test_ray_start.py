"""Starting a local Ray (fabric/ray_session.py): ray.init's wait for the new node is asked often
instead of once a second (``_registration_polled_often``), and a Ray without its dashboard starts
no dashboard process (``_no_dashboard_process``)."""

from __future__ import annotations

import os

import psutil
import ray

from fabric.ray_session import _no_dashboard_process, _registration_polled_often, wait_for_node


def _this_node(ray_module) -> tuple[str, str]:
    context = ray_module.get_runtime_context()
    return context.gcs_address, context.get_node_id()


def test_wait_for_node_finds_a_registered_node(ray_session):
    gcs_address, node_id = _this_node(ray_session)
    assert wait_for_node(gcs_address, node_id, timeout_s=5, interval_s=0.05)


def test_wait_for_node_gives_up_on_a_node_that_never_registers(ray_session):
    gcs_address, node_id = _this_node(ray_session)
    stranger = ("0" if node_id[0] != "0" else "1") + node_id[1:]
    assert not wait_for_node(gcs_address, stranger, timeout_s=0.3, interval_s=0.05)


def test_the_lookup_answers_as_rays_own_and_is_restored_after(ray_session):
    gcs_address, node_id = _this_node(ray_session)
    services = ray._private.services
    lookup = services.get_node
    with _registration_polled_often():
        assert services.get_node is not lookup
        assert services.get_node(gcs_address, node_id) == lookup(gcs_address, node_id)
    assert services.get_node is lookup


def test_a_local_ray_without_its_dashboard_runs_no_dashboard_process(ray_session):
    node = ray._private.worker._global_node  # the session's Ray, started by connect() in this process
    assert ray._private.ray_constants.PROCESS_TYPE_DASHBOARD not in node.all_processes
    assert node.webui_url == ""  # what Ray records for a Ray started without its dashboard
    session_dir = node.get_session_dir_path()
    dashboards = [p for p in psutil.Process(os.getpid()).children(recursive=True)
                  if any(part.endswith(os.path.join("dashboard", "dashboard.py")) for part in _cmdline(p))
                  and any(session_dir in part for part in _cmdline(p))]
    assert dashboards == []
    # The rest of the node is there: the raylet and the GCS it started, and workers run tasks.
    assert {"raylet", "gcs_server"} <= set(node.all_processes)
    def pid() -> int:  # defined here, so Ray ships it by value (test modules are no package)
        return os.getpid()

    assert ray.get(ray.remote(num_cpus=0)(pid).remote()) != os.getpid()


def test_the_dashboard_start_is_rays_own_again_after():
    node_class = ray._private.node.Node
    start = node_class.start_api_server
    with _no_dashboard_process():
        assert node_class.start_api_server is not start
    assert node_class.start_api_server is start


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # ended meanwhile
        return []
