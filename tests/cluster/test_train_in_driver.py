"""train_in_driver: which runs may train in the driver process (fabric/train_in_driver.py), and the
one error for a config that insists on it where a Ray Train worker group is needed."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from fabric.ray_args import RayArguments
from tests.cluster.conftest import BASE, error_of

LONE_LOCAL = dict(streaming=False, deepspeed=False, rl=False)


def test_a_lone_local_cpu_worker_needs_no_worker_group(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert RayArguments().worker_group_reasons(**LONE_LOCAL) == []


@pytest.mark.parametrize("ray_keys, job, reason", [
    ({"ray_num_workers": 2}, {}, "ray_num_workers is 2"),
    ({"resources_per_worker": {"CPU": 1, "GPU": 1}}, {}, "resources_per_worker asks for a GPU"),
    ({}, {"streaming": True}, "streaming is true"),
    ({}, {"deepspeed": True}, "deepspeed is set"),
    ({"max_failures": 1}, {}, "max_failures is 1"),
    ({"max_failures": -1}, {}, "max_failures is -1"),
    ({}, {"rl": True}, "an RL stage runs its roles as actor groups"),
    ({"ray_address": "10.0.0.5:6379"}, {}, "the run joins the Ray cluster at 10.0.0.5:6379"),
    ({"ray_storage_path": "s3://bucket/runs"}, {}, "ray_storage_path is s3://bucket/runs"),
    ({"ray_run_name": "nightly"}, {}, "ray_run_name names a run in Ray storage"),
])
def test_each_thing_that_needs_a_worker_group_is_named(monkeypatch, ray_keys, job, reason):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    reasons = RayArguments(**ray_keys).worker_group_reasons(**{**LONE_LOCAL, **job})
    assert len(reasons) == 1 and reasons[0].startswith(reason), reasons


def test_a_cluster_in_ray_address_needs_a_worker_group(monkeypatch):
    """ray job submit sets RAY_ADDRESS: the run's workers belong on the cluster, not in the driver."""
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert RayArguments().worker_group_reasons(**LONE_LOCAL) == ["the run joins the Ray cluster at ray://head:10001"]


def test_insisting_on_the_driver_where_a_worker_group_is_needed_is_one_error(in_tmp, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert error_of({**BASE, "train_in_driver": True, "ray_num_workers": 2, "max_failures": 1}) == (
        "train_in_driver is true in the config dict, but this run needs a Ray Train worker group: "
        "ray_num_workers is 2; max_failures is 1 (restarts are of a worker group). Remove train_in_driver "
        "(the default trains in the driver wherever it can) or set it to false."
    )


def test_train_in_driver_is_read_from_the_yaml(in_tmp, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert load_config({**BASE, "train_in_driver": True}).ray.train_in_driver is True
    assert load_config({**BASE, "train_in_driver": False, "ray_num_workers": 2}).ray.train_in_driver is False
    assert load_config(dict(BASE)).ray.train_in_driver is None
