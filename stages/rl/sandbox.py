"""A sandboxed Python executor: each call runs code in a fresh, limited interpreter process.

``run_python(code, limits) -> SandboxResult``. What is enforced comes from the run itself (the
boot program reports each step the kernel accepted), never from assumptions; ``result.enforced``
says it per run. On Linux as root, or where unprivileged user namespaces are allowed:

* wall-clock timeout: the parent kills the launcher's process group; the guard (PID 1 of a fresh
  PID namespace) dies with it and the kernel kills everything else in that namespace;
* CPU time: RLIMIT_CPU (SIGXCPU at the soft limit, SIGKILL a second later);
* memory: RLIMIT_AS on the worker (an allocation past it raises MemoryError);
* output: stdout + stderr read up to ``max_output_bytes``, then the run is killed;
* processes: a pids cgroup (``pids.max``) where the cgroup hierarchy is writable, plus
  RLIMIT_NPROC, which Linux does NOT apply to root (uid 0 is exempt whatever its capabilities);
* files: RLIMIT_FSIZE (size of any file written), RLIMIT_NOFILE (open descriptors);
* network: a new network namespace with only a loopback device that is down: no connection
  anywhere, 127.0.0.1 included; abstract Unix sockets of the host are out of reach too;
* filesystem: a private mount namespace where every mount is remounted read-only except the work
  dir (a fresh temporary directory, seen as /tmp/work, deleted afterwards); /tmp, /var/tmp, /run
  and /dev/shm are empty tmpfs mounts (so filesystem Unix sockets there are hidden); /proc is the
  new PID namespace's own (host processes are invisible);
* privileges: the worker enters a new user namespace, losing every capability in the host's
  namespaces (it cannot remount, raise hard rlimits or mount anything the host sees);
* environment: none inherited (only PATH), ``python -I -S`` (no site-packages, no PYTHON*).

Not enforced, even on Linux: reading files the caller's uid can read (the sandbox keeps that uid:
the interpreter and its standard library must stay readable, and root's /root is 0700); filesystem
Unix sockets outside the hidden directories; CPU share (the worker can use a whole core until its
CPU-time limit) and kernel memory not counted in the address space. Without namespaces (not Linux,
or a kernel that refuses them) only the rlimits, the output cap, the process-group kill and the
empty environment hold; ``result.enforced`` then says network and filesystem are False.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from registries.errors import UserError

BOOT = (Path(__file__).parent / "sandbox_boot.py").read_text()
MEMORY_EXIT, FILE_SIZE_EXIT, SETUP_EXIT, PROCESSES_EXIT = 213, 214, 215, 216
CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")  # v1 pids, hybrid v2, v2
MB = 1 << 20


class SandboxError(UserError):
    """The sandbox could not run code at all (not: the code failed, which is a result)."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * MB  # address space: the interpreter alone maps ~30 MB
    max_output_bytes: int = 64 * 1024  # stdout and stderr together
    file_size_bytes: int = 16 * MB
    max_open_files: int = 64
    max_processes: int = 32


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]  # negative: killed by that signal; None: killed by the parent
    limit: Optional[str]  # what stopped it: wall_time, cpu_time, memory, output, file_size, processes
    elapsed: float
    truncated: bool = False  # output was cut at max_output_bytes
    enforced: dict[str, bool] = field(default_factory=dict)  # what this run's isolation achieved
    notes: list[str] = field(default_factory=list)  # why a protection is missing
    processes_capped: bool = False  # a fork was refused by the pids cgroup (whatever stopped the run)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` (the text of a Python program) in a sandbox; its stdout/stderr come back."""
    work_dir = tempfile.mkdtemp(prefix="rayfactory-sandbox-")
    cgroup = _make_cgroup(limits.max_processes)
    status_r, status_w = os.pipe()
    try:
        Path(work_dir, "main.py").write_text(code)
        config = {"work_dir": work_dir, "cgroup": cgroup, "status_fd": status_w, "memory_exit": MEMORY_EXIT,
                  "file_size_exit": FILE_SIZE_EXIT, "setup_exit": SETUP_EXIT,
                  "processes_exit": PROCESSES_EXIT,
                  "limits": {"cpu": limits.cpu_seconds, "memory": limits.memory_bytes,
                             "fsize": limits.file_size_bytes, "nofile": limits.max_open_files,
                             "nproc": limits.max_processes}}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", BOOT, json.dumps(config)], cwd=work_dir,
                env={"PATH": "/usr/bin:/bin"},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                start_new_session=True)  # its own process group, killed whole
        except OSError as exc:
            raise SandboxError(f"The Python sandbox could not start {sys.executable}: {exc}.") from exc
        os.close(status_w)
        status_w = -1
        return _collect(proc, status_r, limits, start, cgroup)
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        _remove_cgroup(cgroup)
        shutil.rmtree(work_dir, ignore_errors=True)


def _collect(proc: subprocess.Popen, status_r: int, limits: SandboxLimits, start: float,
             cgroup: Optional[str]) -> SandboxResult:
    """Read output and status until the run ends, a limit is hit, or its pipes stay open too long."""
    out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    status = bytearray()
    selector = selectors.DefaultSelector()
    for fd in (*out, status_r):
        selector.register(fd, selectors.EVENT_READ)
    killed_for, exited_at = None, None
    deadline = start + limits.wall_seconds
    while selector.get_map():
        now = time.monotonic()
        if now >= deadline:
            killed_for = "wall_time"
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 1.0:  # pipes held open past the end
            break
        for key, _ in selector.select(timeout=min(0.05, deadline - now)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fd)
            elif key.fd == status_r:
                status += chunk
            else:
                out[key.fd] += chunk
        if sum(len(b) for b in out.values()) > limits.max_output_bytes:
            killed_for = "output"
            break
    selector.close()
    _kill(proc, cgroup)
    elapsed = time.monotonic() - start
    report = _read_status(bytes(status))
    if "error" in report:
        raise SandboxError(f"The Python sandbox failed while setting up its isolation: {report['error']}.")
    stdout, stderr = (bytes(b) for b in out.values())
    truncated = len(stdout) + len(stderr) > limits.max_output_bytes
    if truncated:  # keep stdout first, then what room is left for stderr
        stdout = stdout[: limits.max_output_bytes]
        stderr = stderr[: limits.max_output_bytes - len(stdout)]
    exit_code = None if killed_for else _exit_code(report, proc)
    return SandboxResult(
        stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"), exit_code=exit_code,
        limit=killed_for or _limit_from(exit_code, cgroup), elapsed=elapsed, truncated=truncated,
        enforced=report.get("enforced", {}), notes=report.get("notes", []),
        processes_capped=bool(cgroup) and _cgroup_refused_forks(cgroup))


def _read_status(raw: bytes) -> dict:
    """The boot program's JSON lines (enforced, then the worker's exit) merged into one dict."""
    merged: dict = {}
    for line in raw.decode(errors="replace").splitlines():
        try:
            merged.update(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill mid-write
    return merged


def _exit_code(report: dict, proc: subprocess.Popen) -> Optional[int]:
    if "signal" in report:
        return -report["signal"]
    if "exit" in report:
        return report["exit"]
    return proc.returncode or 1  # the boot program died before it could report the worker's end


def _limit_from(exit_code: Optional[int], cgroup: Optional[str]) -> Optional[str]:
    if exit_code == -signal.SIGXCPU:
        return "cpu_time"
    if exit_code == MEMORY_EXIT:
        return "memory"
    if exit_code == FILE_SIZE_EXIT:
        return "file_size"
    if exit_code == PROCESSES_EXIT or (exit_code and cgroup and _cgroup_refused_forks(cgroup)):
        return "processes"
    return None


def _kill(proc: subprocess.Popen, cgroup: Optional[str]) -> None:
    """SIGKILL the whole run: its process group, then any member of its cgroup that escaped it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if cgroup:
        for _ in range(50):
            pids = _cgroup_pids(cgroup)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
    for stream in (proc.stdout, proc.stderr):
        stream.close()


def _make_cgroup(max_processes: int) -> Optional[str]:
    """A pids cgroup for one run, or None where no hierarchy lets us make one (not root, no v1/v2)."""
    for root in CGROUP_ROOTS:
        path = os.path.join(root, f"rayfactory-sandbox-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            Path(path, "pids.max").write_text(str(max_processes))
            return path
        except OSError:  # a v2 root without the pids controller: no pids.max here
            _remove_cgroup(path)
    return None


def _cgroup_pids(cgroup: str) -> list[int]:
    try:
        return [int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _cgroup_refused_forks(cgroup: str) -> bool:
    try:
        events = dict(line.split() for line in Path(cgroup, "pids.events").read_text().splitlines())
    except (OSError, ValueError):
        return False
    return int(events.get("max", 0)) > 0


def _remove_cgroup(cgroup: Optional[str]) -> None:
    if not cgroup:
        return
    for _ in range(100):  # rmdir fails while the last killed members are being reaped
        try:
            os.rmdir(cgroup)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
