"""A Ray head of our own on this machine, with a job server: for the web UI's runs and the tests.

``rayfactory train`` starts a private Ray inside its own process; a run that must outlive the
process that started it (the web UI's Start button, a browser closed mid-run) is a Ray job
instead, and a job needs a head with a dashboard. ``start_head`` runs ``ray start --head`` with
every port chosen free (Ray's fixed defaults would collide with any other Ray on the machine),
in a new session, so ``stop_head`` can find every process of that head, and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

HEAD_START_TIMEOUT_S = 120
PORT_NAMES = (
    "port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
    "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
)


class HeadStartError(RuntimeError):
    """`ray start --head` exited or did not become ready; the message ends with its log."""


@dataclass
class Head:
    session_id: int  # the sid every process of this head shares
    gcs_address: str
    dashboard_url: str
    temp_dir: str
    agent_port: int
    token: str | None = None
    client_port: int | None = None  # the Ray client server's (ray://), for a check that it wants the token

    def save(self, path: str) -> None:
        """The record, readable by this user only (it may hold the head's token)."""
        fd = os.open(f"{path}.partial", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # a file left by an earlier try keeps its mode otherwise
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f)
        os.replace(f"{path}.partial", path)

    @classmethod
    def load(cls, path: str) -> "Head | None":
        """The head recorded at ``path`` if its job server still answers, else None."""
        head = cls.read(path)
        return head if head is not None and dashboard_up(head.dashboard_url) else None

    @classmethod
    def read(cls, path: str) -> "Head | None":
        """The head recorded at ``path``, answering or not (to stop what is left of it); None without a record."""
        try:
            with open(path, encoding="utf-8") as f:
                return cls(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_executable() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def start_head(env: dict[str, str], num_cpus: int, token: str | None = None) -> Head:
    """Start a head (dashboard on 127.0.0.1) and wait until it takes jobs. ``env`` is the whole
    environment of the head (RAY_AUTH_MODE, HOME ... are the caller's choice)."""
    # A short temp dir: Ray's unix socket paths live under it and must stay below ~107 chars.
    temp_dir = tempfile.mkdtemp(prefix="rf-head-", dir="/tmp")
    ports = {name: free_port() for name in PORT_NAMES}
    command = [
        ray_executable(), "start", "--head", f"--num-cpus={num_cpus}", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
        # Loopback where Ray lets a head choose: its node address, and so the Ray client server's.
        # The GCS and raylet still listen on every interface: the head wants Ray's token auth.
        "--node-ip-address=127.0.0.1",
        *(f"--{k}={v}" for k, v in ports.items()),
    ]
    with open(os.path.join(temp_dir, "head.log"), "w") as log:
        # A new session: every process this head spawns (workers included) keeps its session id,
        # after `ray start` itself has returned; that is how stop_head finds them.
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(process.pid, f"127.0.0.1:{ports['port']}", f"http://127.0.0.1:{ports['dashboard-port']}",
                temp_dir, ports["dashboard-agent-listen-port"], token, ports["ray-client-server-port"])
    try:
        _wait_until_ready(head, process)
    except BaseException:
        stop_head(head)
        raise
    return head


def _wait_until_ready(head: Head, process: subprocess.Popen) -> None:
    """Dashboard answering and the head's dashboard agent listening: a job submitted before the
    agent is up fails with 'No available agent to submit job' (seen on this loaded machine)."""
    deadline = time.time() + HEAD_START_TIMEOUT_S
    while time.time() < deadline:
        if process.poll() not in (None, 0):
            raise HeadStartError(f"ray start exited with {process.returncode}:\n{head_log(head)}")
        if dashboard_up(head.dashboard_url) and _port_open(head.agent_port):
            return
        time.sleep(0.5)
    raise HeadStartError(f"the Ray head was not ready after {HEAD_START_TIMEOUT_S}s:\n{head_log(head)}")


def dashboard_up(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/api/version", timeout=2)
        return True
    except urllib.error.HTTPError:
        return True  # 401 under token auth: the server is up
    except OSError:
        return False


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def head_log(head: Head) -> str:
    try:
        with open(os.path.join(head.temp_dir, "head.log"), encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]
    except OSError:
        return "(no head log)"


def stop_head(head: Head) -> None:
    """Kill every process of this head's session, and the processes they started in sessions of
    their own (a Ray job's driver: Ray starts it with start_new_session), and nothing else.

    SIGKILL, not a graceful SIGTERM: after a job ran, Ray drains for ~35 s before it exits on
    this machine, and such a head holds no data worth a clean shutdown (runs write to output_dir).
    """
    import psutil

    deadline = time.time() + 30
    doomed: dict[int, psutil.Process] = {}
    while True:  # again while any is left: a process may start one more before it is killed
        doomed.update((p.pid, p) for p in session_processes(head))
        left = [p for p in doomed.values() if _alive(p)]
        if not left or time.time() > deadline:
            break
        for proc in left:
            try:
                proc.kill()
            except (ProcessLookupError, psutil.Error, PermissionError):
                pass
        time.sleep(0.2)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def session_processes(head: Head) -> list:
    """The head's processes (its session) and their descendants, as psutil.Process objects (which
    remember each one's start time, so a reused pid is never taken for one of them)."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        if _in_session(proc, head.session_id):
            found[proc.pid] = proc
            try:
                found.update((child.pid, child) for child in proc.children(recursive=True))
            except psutil.Error:
                pass
    return list(found.values())


def _alive(proc) -> bool:
    try:
        return proc.is_running() and proc.status() != "zombie"
    except Exception:  # noqa: BLE001 (gone, or not ours to look at)
        return False


def _in_session(proc, session_id: int) -> bool:
    try:
        return os.getsid(proc.pid) == session_id and proc.status() != "zombie"
    except Exception:  # noqa: BLE001 (gone, or not ours to look at)
        return False
