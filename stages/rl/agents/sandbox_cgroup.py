"""The memory and pids cgroup of one sandboxed run, made by the parent before the run starts.

cgroup v2 where the unified hierarchy offers both controllers: one directory with ``memory.max``,
``memory.swap.max`` 0 and ``pids.max``. Otherwise cgroup v1 (as on hybrid hosts, this repo's CI
among them): a directory in the memory hierarchy (``memory.limit_in_bytes``, and
``memory.memsw.limit_in_bytes`` where swap is accounted) and one in the pids hierarchy. Each is made
below the cgroup the caller already runs in, so the caller's own limits still bind the run. The
run's launcher joins them first thing, so every process of the run is counted together: memory is
the whole process tree's (tmpfs pages its work directory holds included), not each process's.

cgroup v2 forbids a cgroup that holds processes to hand controllers to children (the "no internal
processes" rule; the root cgroup is exempt). Where the caller's own cgroup holds processes and has
no controllers for its children yet, the caller moves itself into a leaf next to the runs'
(``rayfactory-sandbox-host``); when other processes still hold it, the run is refused.

Anything that cannot be made raises ``CgroupUnavailable`` naming what is missing.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path


class CgroupUnavailable(Exception):
    """No memory or pids cgroup can be made for a run here; the message says why."""


@dataclass(frozen=True)
class RunCgroup:
    memory: str  # the directory with the memory limit
    pids: str  # the directory with pids.max (the same one on cgroup v2)
    v2: bool

    @property
    def dirs(self) -> list[str]:
        return list(dict.fromkeys([self.memory, self.pids]))

    def oom_kills(self) -> int:
        """Processes of the run the kernel killed for the memory limit."""
        events = _counters(Path(self.memory, "memory.events" if self.v2 else "memory.oom_control"))
        return events.get("oom_kill", 0)

    def refused_forks(self) -> bool:
        return _counters(Path(self.pids, "pids.events")).get("max", 0) > 0

    def kill(self) -> None:
        """SIGKILL every process still in the run's cgroups, until none is left."""
        for _ in range(100):
            pids = {int(p) for d in self.dirs for p in _read(Path(d, "cgroup.procs")).split()}
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(100):  # rmdir fails while the last killed members are being reaped
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def make_cgroup(memory_bytes: int, max_processes: int) -> RunCgroup:
    """A fresh cgroup (v2) or pair (v1) with the run's limits, below the caller's own."""
    mounts, own = _mounts(), _own_cgroups()
    name = f"rayfactory-sandbox-{uuid.uuid4().hex[:12]}"
    if "" in mounts and "" in own:
        base = _join(mounts[""], own[""])
        if {"memory", "pids"} <= set(_read(Path(base, "cgroup.controllers")).split()):
            return _make_v2(base, name, memory_bytes, max_processes)
    missing = [c for c in ("memory", "pids") if c not in mounts or c not in own]
    if missing:
        raise CgroupUnavailable(f"no cgroup hierarchy offers the {' and '.join(missing)} controller "
                                f"(cgroup v2 at {mounts.get('', 'nowhere')} lacks it, and no cgroup v1 has it)")
    memory = _mkdir(_join(mounts["memory"], own["memory"]), name)
    try:
        _write(Path(memory, "memory.limit_in_bytes"), memory_bytes)
        if Path(memory, "memory.memsw.limit_in_bytes").exists():  # memory + swap: no way out through swap
            _write(Path(memory, "memory.memsw.limit_in_bytes"), memory_bytes)
        pids = _mkdir(_join(mounts["pids"], own["pids"]), name)
    except CgroupUnavailable:
        RunCgroup(memory, memory, False).remove()
        raise
    cgroup = RunCgroup(memory, pids, False)
    try:
        _write(Path(pids, "pids.max"), max_processes)
    except CgroupUnavailable:
        cgroup.remove()
        raise
    return cgroup


def _make_v2(base: str, name: str, memory_bytes: int, max_processes: int) -> RunCgroup:
    subtree = Path(base, "cgroup.subtree_control")
    if not {"memory", "pids"} <= set(_read(subtree).split()):
        try:
            subtree.write_text("+memory +pids")
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise CgroupUnavailable(f"enabling memory and pids below {base}: {exc.strerror}") from None
            _write(Path(_mkdir(base, "rayfactory-sandbox-host", exist_ok=True), "cgroup.procs"), os.getpid())
            try:
                subtree.write_text("+memory +pids")
            except OSError as exc:
                raise CgroupUnavailable(
                    f"enabling memory and pids below {base}: {exc.strerror} (cgroup v2 hands controllers only to "
                    "the children of a cgroup without processes, and others than this one are in it)") from None
    path = _mkdir(base, name)
    cgroup = RunCgroup(path, path, True)
    try:
        _write(Path(path, "memory.max"), memory_bytes)
        if Path(path, "memory.swap.max").exists():
            _write(Path(path, "memory.swap.max"), 0)
        _write(Path(path, "pids.max"), max_processes)
    except CgroupUnavailable:
        cgroup.remove()
        raise
    return cgroup


def _mounts() -> dict[str, str]:
    """Where each hierarchy is mounted: "" for cgroup v2, else by v1 controller ("memory", "pids")."""
    found: dict[str, str] = {}
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        fields, (fstype, _, options) = left.split(), (right.split() + ["", "", ""])[:3]
        point = fields[4].encode().decode("unicode_escape")  # mountinfo writes a space as \040
        if fstype == "cgroup2":
            found.setdefault("", point)
        elif fstype == "cgroup":
            for controller in set(options.split(",")) & {"memory", "pids"}:
                found.setdefault(controller, point)
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per hierarchy, keyed as ``_mounts``, from /proc/self/cgroup."""
    own: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and not controllers:
            own[""] = path
        for controller in set(controllers.split(",")) & {"memory", "pids"}:
            own[controller] = path
    return own


def _join(mount_point: str, path: str) -> str:
    return os.path.join(mount_point, path.lstrip("/"))


def _mkdir(parent: str, name: str, exist_ok: bool = False) -> str:
    path = os.path.join(parent, name)
    try:
        os.makedirs(path, exist_ok=exist_ok)
    except OSError as exc:
        raise CgroupUnavailable(f"making {path}: {exc.strerror}") from None
    return path


def _write(path: Path, value) -> None:
    try:
        path.write_text(str(value))
    except OSError as exc:
        raise CgroupUnavailable(f"setting {path} to {value}: {exc.strerror}") from None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _counters(path: Path) -> dict[str, int]:
    pairs = (line.split() for line in _read(path).splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
