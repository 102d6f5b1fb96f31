"""Starting a local Ray: ray.init's wait for the new node is asked often instead of once a second
(fabric/ray_session.py, ``_registration_polled_often``)."""

from __future__ import annotations

import ray

from fabric.ray_session import _registration_polled_often, wait_for_node


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
