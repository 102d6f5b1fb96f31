"""A sandboxed Python executor: each call runs code in a fresh, isolated interpreter process.

``run_python(code, limits) -> SandboxResult``. Isolated (the default) or refused: every piece below
is put in place for each run, and where one cannot be, no code runs and ``SandboxUnavailable``
names the piece; a caller accepts running without isolation only by asking for
``sandbox="unisolated"`` (the RL config's ``sandbox: unisolated``). Isolated, on Linux as root:

* filesystem: a fresh minimal root (stages/rl/agents/sandbox_root.py) with read-only binds of the
  interpreter's standard library and the system's shared libraries, nothing else of the host's:
  no /etc/shadow, /root, /home, project checkout, caches or venv; ``pivot_root`` into it;
* work dir: /tmp, a tmpfs of ``disk_bytes`` owned by the sandbox user, gone with the run;
* user: uid/gid 65534 with no capabilities and no_new_privs; every mount nosuid (and nodev but for
  /dev's five device files), so nothing it writes is owned by uid 0 or setuid-effective;
* memory: a memory cgroup for the whole process tree (stages/rl/agents/sandbox_cgroup.py), plus
  RLIMIT_AS on each process (an allocation past it raises MemoryError, a readable end);
* processes: the same cgroup's ``pids.max``;
* network: a network namespace with a loopback that is down: TCP, UDP, IPv4 and IPv6 reach
  nothing, abstract Unix sockets are the namespace's own, and no host socket file is in the root;
* processes seen: a PID namespace; /proc shows the sandbox user's processes only;
* wall clock: the parent kills the launcher's process group and the cgroup; the guard (PID 1 of
  the namespace) dies with it and the kernel kills everything else in the namespace;
* CPU time: RLIMIT_CPU, SIGXCPU at the limit and SIGKILL a second later (a program that ignores
  SIGXCPU is still reported as stopped by the CPU limit);
* output: stdout + stderr read up to ``max_output_bytes``, then the run is killed;
* files: RLIMIT_FSIZE (each file), RLIMIT_NOFILE (open descriptors);
* environment: none inherited (only PATH), ``python -I -S`` (no site-packages, no PYTHON*).

Not covered: system calls are not filtered (no seccomp: the kernel's attack surface is an
unprivileged process's), CPU share (a core until the CPU-time limit) and the time it takes.
Unisolated, only the rlimits (RLIMIT_NPROC too), the output cap, the process-group kill and the
empty environment hold; the code can read and write whatever the caller can.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from registries.errors import UserError

from .sandbox_cgroup import CgroupUnavailable, RunCgroup, make_cgroup

HERE = Path(__file__).parent
BOOT = (HERE / "sandbox_boot.py").read_text()
EXITS = {"memory": 213, "file_size": 214, "setup": 215, "processes": 216, "disk": 217}
SANDBOX_UID = 65534  # nobody: the code's uid and gid, never root's
MODES = ("isolated", "unisolated")
PIECES = ("minimal_root", "work_dir_size", "unprivileged_user", "memory_cgroup", "processes_cgroup",
          "network", "pid_namespace")
OPT_IN = ("To run the code without isolation anyway (it can then read and write whatever this process can), "
          "set `sandbox: unisolated` in the RL config (run_python(..., sandbox='unisolated')).")
MB = 1 << 20


class SandboxError(UserError):
    """The sandbox could not run code at all (not: the code failed, which is a result)."""


class SandboxUnavailable(SandboxError):
    """A piece of the isolation cannot be enforced here, so the code was not run."""

    def __init__(self, piece: str):
        self.piece = piece
        super().__init__(f"The Python sandbox cannot isolate code here, so it runs none: {piece}. {OPT_IN}")


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * MB  # the whole run's (cgroup), and each process's address space
    max_output_bytes: int = 64 * 1024  # stdout and stderr together
    file_size_bytes: int = 16 * MB
    disk_bytes: int = 64 * MB  # the work dir: a tmpfs, its pages counted in memory_bytes too
    max_open_files: int = 64
    max_processes: int = 32


STOPS = {  # what result.stopped says for each limit
    "wall_time": lambda l: f"the wall-clock limit ({l.wall_seconds:g} s)",
    "cpu_time": lambda l: f"the CPU-time limit ({l.cpu_seconds} s)",
    "memory": lambda l: f"the memory limit ({l.memory_bytes / MB:g} MiB for all its processes together)",
    "output": lambda l: f"the output limit ({l.max_output_bytes / 1024:g} KiB)",
    "file_size": lambda l: f"the file-size limit ({l.file_size_bytes / MB:g} MiB per file)",
    "disk": lambda l: f"disk full: the work directory's size limit ({l.disk_bytes / MB:g} MiB)",
    "processes": lambda l: f"the process limit ({l.max_processes} processes)",
}


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]  # negative: killed by that signal; None: killed by the parent
    limit: Optional[str]  # what stopped it: a key of STOPS
    elapsed: float
    truncated: bool = False  # output was cut at max_output_bytes
    enforced: dict[str, bool] = field(default_factory=dict)  # each piece of isolation: all True, or unisolated
    processes_capped: bool = False  # a fork was refused by the pids cgroup (whatever stopped the run)
    limits: SandboxLimits = SandboxLimits()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None

    @property
    def stopped(self) -> str:
        """The line "[stopped: ...]" naming what ended the run; "" when the program ended by itself."""
        if self.limit:
            return f"[stopped: {STOPS[self.limit](self.limits)}]"
        if self.exit_code is not None and self.exit_code < 0:
            try:
                name = signal.Signals(-self.exit_code).name
            except ValueError:  # a real-time signal has no name
                name = f"signal {-self.exit_code}"
            return f"[stopped: killed by {name}]"
        return ""


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), sandbox: str = "isolated") -> SandboxResult:
    """Run ``code`` (the text of a Python program) in a sandbox; its stdout/stderr come back.
    Raises SandboxUnavailable, and runs nothing, where ``sandbox="isolated"`` cannot be enforced."""
    if sandbox not in MODES:
        raise ValueError(f"sandbox must be one of {MODES}, got {sandbox!r}.")
    isolated = sandbox == "isolated"
    if isolated:
        _check_platform()
    cgroup = _cgroup(limits) if isolated else None
    work_dir = None if isolated else tempfile.mkdtemp(prefix="rayfactory-sandbox-")
    status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        with tempfile.TemporaryFile() as code_file:
            code_file.write(code.encode())
            code_file.seek(0)
            proc = _start(_config(limits, isolated, status_w, code_file.fileno(), cgroup, work_dir), work_dir)
        os.close(status_w)
        status_w = -1
        return _collect(proc, status_r, limits, start, cgroup)
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if cgroup:  # every process of the run, whatever group or session it moved to
            cgroup.kill()
            cgroup.remove()
        if work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


def check_isolation() -> None:
    """Raise SandboxUnavailable (naming the piece) unless an isolated run works here."""
    result = run_python("print('isolated')")
    if result.stdout != "isolated\n":
        raise SandboxUnavailable(f"a test run ended {result.stopped or result.exit_code}: {result.stderr[-300:]!r}")


def _check_platform() -> None:
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"namespaces and cgroups are Linux's, this is {sys.platform}")
    if os.geteuid() != 0:
        raise SandboxUnavailable(f"the sandbox is built as root (mounts, namespaces, a memory cgroup, then uid "
                                 f"{SANDBOX_UID}); this process runs as uid {os.geteuid()}")


def _cgroup(limits: SandboxLimits) -> RunCgroup:
    try:
        return make_cgroup(limits.memory_bytes, limits.max_processes)
    except CgroupUnavailable as exc:
        raise SandboxUnavailable(f"memory and pids cgroup: {exc}") from None


def _config(limits: SandboxLimits, isolated: bool, status_fd: int, code_fd: int, cgroup: Optional[RunCgroup],
            work_dir: Optional[str]) -> dict:
    return {"isolated": isolated, "status_fd": status_fd, "code_fd": code_fd, "work_dir": work_dir,
            "cgroups": cgroup.dirs if cgroup else [], "uid": SANDBOX_UID, "exits": EXITS,
            "root_module": str(HERE / "sandbox_root.py"),
            "limits": {"cpu": limits.cpu_seconds, "memory": limits.memory_bytes, "fsize": limits.file_size_bytes,
                       "disk": limits.disk_bytes, "nofile": limits.max_open_files, "nproc": limits.max_processes}}


def _start(config: dict, work_dir: Optional[str]) -> subprocess.Popen:
    # The interpreter itself, not a venv's link to it: only the interpreter is in the minimal root.
    python = os.path.realpath(sys.executable or "")
    try:
        return subprocess.Popen(
            [python, "-I", "-S", "-c", BOOT, json.dumps(config)], cwd=work_dir or "/", env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(config["status_fd"], config["code_fd"]), start_new_session=True)  # its own group, killed whole
    except OSError as exc:
        raise SandboxError(f"The Python sandbox could not start {python}: {exc}.") from exc


def _collect(proc: subprocess.Popen, status_r: int, limits: SandboxLimits, start: float,
             cgroup: Optional[RunCgroup]) -> SandboxResult:
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
    _kill(proc)
    elapsed = time.monotonic() - start
    report = _read_status(bytes(status))
    stdout, stderr = (bytes(b) for b in out.values())
    if "unavailable" in report:
        raise SandboxUnavailable(report["unavailable"])
    if "started" not in report:  # a bug in the setup, or the launcher was killed during it
        raise SandboxError("The Python sandbox failed while setting up its isolation: "
                           f"{report.get('error') or killed_for or stderr[-500:].decode(errors='replace')}.")
    truncated = len(stdout) + len(stderr) > limits.max_output_bytes
    if truncated:  # keep stdout first, then what room is left for stderr
        stdout = stdout[: limits.max_output_bytes]
        stderr = stderr[: limits.max_output_bytes - len(stdout)]
    exit_code = None if killed_for else _exit_code(report, proc)
    capped = bool(cgroup) and cgroup.refused_forks()
    return SandboxResult(
        stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"), exit_code=exit_code,
        limit=killed_for or _limit_from(exit_code, report, cgroup, capped, limits), elapsed=elapsed,
        truncated=truncated, enforced={piece: cgroup is not None for piece in PIECES}, processes_capped=capped,
        limits=limits)


def _read_status(raw: bytes) -> dict:
    """The boot program's JSON lines (started, then the worker's end) merged into one dict."""
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


def _limit_from(exit_code: Optional[int], report: dict, cgroup: Optional[RunCgroup], capped: bool,
                limits: SandboxLimits) -> Optional[str]:
    if exit_code == -signal.SIGXCPU:
        return "cpu_time"
    if exit_code == EXITS["memory"] or (cgroup and cgroup.oom_kills()):  # a process of the tree was OOM-killed
        return "memory"
    if exit_code == -signal.SIGKILL and report.get("cpu", 0) >= limits.cpu_seconds:  # SIGXCPU ignored: the hard limit
        return "cpu_time"
    if exit_code == EXITS["file_size"]:
        return "file_size"
    if exit_code == EXITS["disk"]:
        return "disk"
    if exit_code == EXITS["processes"] or (exit_code and capped):
        return "processes"
    return None


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (run_python then empties its cgroup of any escapee)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()
