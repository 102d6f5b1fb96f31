"""Every Ray the project starts itself is authenticated (issue 63): an outsider on this machine, with
none of its token, gets nothing from it.

Ray's GCS and raylets listen on every interface whatever a node's address, so the token is what
keeps others out. The outsider is a fresh Python process with no RAY_* variables and a HOME of its
own (no ~/.ray/auth_token): it asks the GCS for its nodes (what ``ray.init(address=...)`` does first),
connects to the Ray client server (``ray://``) where there is one, and asks the job server for jobs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.ray

PROBE = r"""
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10)
    print("GCS-ANSWERED")
except Exception as exc:
    print("GCS-REFUSED", type(exc).__name__, str(exc)[:300])
if len(sys.argv) > 2:
    import ray
    try:
        ray.init(sys.argv[2])
        print("CLIENT-ANSWERED", ray.cluster_resources())
    except Exception as exc:
        print("CLIENT-REFUSED", type(exc).__name__, str(exc)[:300])
"""


def outsider(tmp_path, gcs_address: str, client_address: str | None = None, token: str | None = None) -> str:
    """What the probe printed, run as a process that knows the address only (or a wrong ``token``)."""
    home = tmp_path / "outsider-home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "RAY_CLIENT_RECONNECT_GRACE_PERIOD": "0"}
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    args = [sys.executable, "-c", PROBE, gcs_address] + ([client_address] if client_address else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)
    return done.stdout


def assert_refused(printed: str, client: bool = False) -> None:
    assert "GCS-REFUSED" in printed and "GCS-ANSWERED" not in printed, printed
    assert "Authentication" in printed or "InvalidAuthToken" in printed, printed
    if client:
        assert "CLIENT-REFUSED" in printed and "CLIENT-ANSWERED" not in printed, printed


def test_the_local_ray_that_train_serve_and_predict_start_wants_its_token(ray_session, tmp_path):
    """The suite's Ray is fabric.ray_session.connect()'s, as `rayfactory train`, `serve` and `predict`
    start theirs: token auth on, the GCS refusing a caller without the token, and a wrong one."""
    gcs = ray_session.get_runtime_context().gcs_address
    assert os.environ.get("RAY_AUTH_MODE") == "token"
    assert_refused(outsider(tmp_path, gcs))
    assert_refused(outsider(tmp_path, gcs, token="0" * 64))


def test_the_web_ui_head_wants_its_token(tmp_path):
    """The web UI's own head (cluster/webui/runs.py): a token of its own, kept in a file only this user
    reads; the UI's job client works with it, and the GCS, the Ray client server and the job server
    refuse a caller without it."""
    from cluster.local_head import stop_head
    from cluster.webui.runs import HEAD_FILE, Runs

    runs = Runs(str(tmp_path / "share"), cwd=str(tmp_path))
    head = runs._head()
    try:
        assert head.token and len(head.token) >= 32
        assert os.stat(tmp_path / "share" / HEAD_FILE).st_mode & 0o077 == 0
        assert runs._client().list_jobs() == []  # the UI itself gets in
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(head.dashboard_url + "/api/jobs/", timeout=10)
        assert refused.value.code == 401
        assert_refused(outsider(tmp_path, head.gcs_address, f"ray://127.0.0.1:{head.client_port}"), client=True)
        assert_refused(outsider(tmp_path, head.gcs_address, token=head.token[::-1]))
    finally:
        stop_head(head)
