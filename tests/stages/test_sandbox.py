"""The Python sandbox against what escapes are made of: each attack gets nowhere (the limits each
run is stopped by are test_sandbox_limits.py's).

The attacks run isolated (the default): where this machine cannot isolate a run (not root, no
namespaces, no memory cgroup) they skip with the missing piece, except under CI=true, where that is
a failure (tests/ci.py). No test accepts an escape: each checks from the host where it can (a
listener that must receive nothing, a file's owner and mount seen through /proc/<pid>/root, the
host's processes) and that the sandbox's own account (``limit``, ``stopped``) names what happened.
The refusals (a piece missing: nothing runs) and the opt-in unisolated mode are tested everywhere.
"""

import glob
import os
import socket
import stat
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stages.rl.agents import sandbox
from stages.rl.agents.sandbox import SandboxLimits, SandboxUnavailable, run_python
from stages.rl.agents.sandbox_cgroup import CgroupUnavailable
from tests.stages.test_sandbox_limits import FAST, NAME_ITSELF, _marker, _processes_named, run

@pytest.fixture
def host_secrets(tmp_path):
    """Host files a sandboxed program must not read: path -> a line of their text. The ones made
    here (in ~/.cache and the test's tmp dir) are removed afterwards."""
    secret, name = f"secret-{uuid.uuid4().hex}", f"rayfactory-sandbox-test-{uuid.uuid4().hex}.txt"
    made = [Path.home() / ".cache" / name, tmp_path / name]
    for path in made:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secret + "\n")
    secrets = {str(p): secret for p in made}
    checkout = Path(__file__).resolve().parents[2]
    for path in ("/etc/shadow", str(Path.home() / ".bashrc"), __file__, str(checkout / "pyproject.toml"),
                 f"/proc/{os.getpid()}/environ"):  # this process's environment, by its host pid
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                secrets[path] = next((line.strip("\0\n ") for line in f if len(line.strip()) > 8), "")
    yield secrets
    for path in made:
        path.unlink()


def test_no_host_file_can_be_read(isolated, host_secrets):
    paths = sorted(host_secrets) + ["/proc/1/root/etc/shadow", "/proc/self/root/../../etc/shadow",
                                    "../../../../etc/shadow"]
    result = run(f"""
        for path in {paths!r}:
            try:
                with open(path) as f:
                    print(path, "READ", f.read(200).replace("\\n", " "))
            except OSError as exc:
                print(path, type(exc).__name__)
    """)
    assert result.ok, result.stderr
    outcomes = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    assert sorted(outcomes) == sorted(paths) and set(outcomes.values()) == {"FileNotFoundError"}, result.stdout
    assert not any(line and line in result.stdout for line in host_secrets.values())


def test_nothing_outside_the_work_dir_can_be_written(isolated, tmp_path):
    targets = [str(tmp_path / "escaped.txt"), "/escaped.txt", "/usr/lib/escaped.txt", "/dev/escaped.txt",
               f"{sys.base_prefix}/escaped.txt", "/etc/ld.so.cache"]
    result = run(f"""
        for path in {targets!r}:
            try:
                with open(path, "a") as f:
                    f.write("escaped")
                print("written", path)
            except OSError as exc:
                print(type(exc).__name__, path)
        open("inside.txt", "w").write("ok")
        print(open("inside.txt").read(), sorted(__import__("os").listdir(".")))
    """)
    assert result.ok, result.stderr
    assert "written" not in result.stdout and result.stdout.splitlines()[-1] == "ok ['inside.txt', 'main.py']"
    assert not any(os.path.exists(t) and "escaped" in Path(t).read_text(errors="replace") for t in targets)


def test_a_setuid_copy_is_neither_root_owned_nor_setuid_effective(isolated):
    """The report's attack: copy a shell (here the interpreter: no /bin/sh is in the root) into the
    work dir as mode 4755 and hand it to another user. Checked from the host, on the live run."""
    marker = _marker()
    code = f"""
        import os, shutil, sys, time
        MARKER = {marker!r}
        {NAME_ITSELF}
        shutil.copy(sys.executable, "sh")
        os.chmod("sh", 0o4755)
        try:
            os.chown("sh", 0, 0)
            print("chowned")
        except OSError as exc:
            print("chown", type(exc).__name__)
        time.sleep(4)
    """
    limits = SandboxLimits(wall_seconds=8.0)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run, code, limits)
        found, deadline = None, time.monotonic() + 6
        while found is None and time.monotonic() < deadline:
            for pid in _processes_named(marker):
                path = f"/proc/{pid}/root/tmp/sh"
                try:
                    if os.stat(path).st_mode & stat.S_ISUID:
                        found = (pid, os.stat(path), Path(f"/proc/{pid}/mountinfo").read_text())
                except OSError:
                    pass
            time.sleep(0.05)
        result = future.result()
    assert found is not None, "the copy never appeared: " + result.stderr
    _, st, mountinfo = found
    assert st.st_uid == sandbox.SANDBOX_UID and st.st_gid == sandbox.SANDBOX_UID and st.st_uid != 0
    work_mount = next(line.split() for line in mountinfo.splitlines() if line.split()[4] == "/tmp")
    assert "nosuid" in work_mount[5].split(",") and "nodev" in work_mount[5].split(",")
    assert all("nosuid" in line.split()[5].split(",") for line in mountinfo.splitlines())  # every mount
    assert result.stdout == "chown PermissionError\n", result.stderr


def _listener(kind: str, tmp_path: Path):
    """A host socket the sandbox will aim at, its address, and how to see whether anything arrived."""
    if kind in ("tcp4", "tcp6", "unix", "abstract"):
        family = {"tcp4": socket.AF_INET, "tcp6": socket.AF_INET6}.get(kind, socket.AF_UNIX)
        s = socket.socket(family, socket.SOCK_STREAM)
        address = {"tcp4": ("127.0.0.1", 0), "tcp6": ("::1", 0), "unix": str(tmp_path / "host.sock"),
                   "abstract": f"\0rayfactory-{uuid.uuid4().hex}"}[kind]
        s.bind(address)
        s.listen(4)
    else:
        s = socket.socket(socket.AF_INET if kind == "udp4" else socket.AF_INET6, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1" if kind == "udp4" else "::1", 0))
    s.settimeout(0.5)
    name = s.getsockname()
    return s, (list(name[:2]) if isinstance(name, tuple) else name)


def _arrived(s: socket.socket) -> bool:
    try:
        if s.type == socket.SOCK_STREAM:
            s.accept()[0].close()
        else:
            s.recvfrom(64)
        return True
    except socket.timeout:
        return False


@pytest.mark.parametrize("kind", ["tcp4", "udp4", "tcp6", "udp6", "unix", "abstract"])
def test_no_socket_reaches_the_host(isolated, tmp_path, kind):
    try:
        listener, address = _listener(kind, tmp_path)
    except OSError as exc:  # a host without ::1
        pytest.skip(f"no {kind} listener can be made on this host: {exc}")
    family = {"4": "AF_INET", "6": "AF_INET6"}.get(kind[-1], "AF_UNIX")
    kind_name = "SOCK_DGRAM" if kind.startswith("udp") else "SOCK_STREAM"
    target = tuple(address) if isinstance(address, list) else address
    try:
        result = run(f"""
            import socket
            s = socket.socket(socket.{family}, socket.{kind_name})
            s.settimeout(1)
            try:
                if s.type == socket.SOCK_DGRAM:
                    for _ in range(3):
                        s.sendto(b"escaped", {target!r})
                else:
                    s.connect({target!r})
                    s.sendall(b"escaped")
                print("sent")
            except OSError as exc:
                print(type(exc).__name__, exc.errno)
        """)
        arrived = _arrived(listener)
    finally:
        listener.close()
    assert not arrived, f"a {kind} connection from the sandbox reached the host"
    assert result.ok and result.stdout.split()[0] != "sent", result.stdout + result.stderr


def test_proc_shows_no_host_process(isolated):
    result = run("""
        import os
        print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        print(os.path.exists("/proc/1"), os.path.exists("/proc/sys"))
    """)
    assert result.ok, result.stderr
    pids, hidden = result.stdout.splitlines()
    assert pids == "[2]"  # the code itself; PID 1 (the guard, root) is hidden too
    assert hidden == "False False"


def test_no_environment_no_capabilities_no_way_back_to_root(isolated):
    os.environ["RAYFACTORY_SANDBOX_SECRET"] = "s3cret"
    try:
        result = run("""
            import ctypes, os, resource
            print(sorted(k for k in os.environ if k != "LC_CTYPE"))  # LC_CTYPE: Python's own C-locale coercion
            status = dict(line.split(":", 1) for line in open("/proc/self/status"))
            print(os.getuid(), os.getgid(), os.getgroups(), status["CapEff"].strip(), status["NoNewPrivs"].strip())
            for attempt in (lambda: os.setuid(0), lambda: resource.setrlimit(resource.RLIMIT_CPU, (100, 100))):
                try:
                    attempt()
                    print("allowed")
                except (OSError, ValueError) as exc:
                    print(type(exc).__name__)
            libc = ctypes.CDLL(None, use_errno=True)
            print(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None), libc.unshare(0x00020000))  # a mount; CLONE_NEWNS
        """)
    finally:
        del os.environ["RAYFACTORY_SANDBOX_SECRET"]
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["['PATH']", "65534 65534 [] 0000000000000000 1", "PermissionError",
                                          "ValueError", "-1 -1"]


def _run_cgroups() -> set[str]:
    return set(glob.glob("/sys/fs/cgroup/**/rayfactory-sandbox-[0-9a-f]*", recursive=True))


def _in_use(cgroup: str) -> bool:
    try:
        return bool(Path(cgroup, "cgroup.procs").read_text().strip())
    except OSError:  # removed meanwhile
        return False


def test_concurrent_runs_are_independent_and_leave_no_files_or_cgroups(isolated):
    before = _run_cgroups()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run(f"print({i} * {i})"), range(8)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]
    # Left behind: a run cgroup that did not exist before and still stands, empty, after a moment.
    # (Another pytest-xdist worker's sandbox runs may hold cgroups of their own meanwhile: those have
    # processes in them, or are gone a moment later.)
    deadline = time.monotonic() + 3
    while (leaked := {c for c in _run_cgroups() - before if not _in_use(c)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leaked


# --- refusals and the opt-in -------------------------------------------------------------------------

def _refused(tmp_path, piece: str):
    """run_python refuses, naming ``piece`` and the opt-in, and the code never ran."""
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable, match=piece) as info:
        run_python(f"open({str(marker)!r}, 'w').write('ran')")
    assert "sandbox: unisolated" in str(info.value)
    assert not marker.exists()


def test_no_memory_cgroup_means_no_run(monkeypatch, tmp_path):
    def no_cgroup(*args):
        raise CgroupUnavailable("no cgroup hierarchy offers the memory controller")
    monkeypatch.setattr(sandbox, "make_cgroup", no_cgroup)
    _refused(tmp_path, "memory and pids cgroup: no cgroup hierarchy offers the memory controller")


def test_not_root_means_no_run(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    _refused(tmp_path, "built as root.*runs as uid 1000")


def test_a_sandbox_user_that_keeps_root_means_no_run(isolated, monkeypatch, tmp_path):
    """Planted: the worker told to stay uid 0. Its own check after dropping privileges refuses."""
    monkeypatch.setattr(sandbox, "SANDBOX_UID", 0)
    _refused(tmp_path, r"unprivileged user: ids \[0\] and capabilities")


def test_unisolated_runs_only_when_asked_and_says_nothing_is_isolated():
    result = run_python("print(6 * 7)", FAST, sandbox="unisolated")
    assert result.ok and result.stdout == "42\n"
    assert result.enforced == {piece: False for piece in sandbox.PIECES}
    with pytest.raises(ValueError, match="sandbox must be one of"):
        run_python("print(1)", FAST, sandbox="off")


def test_unisolated_runs_keep_their_limits():
    result = run_python("while True: pass", FAST, sandbox="unisolated")
    assert result.limit == "cpu_time"
    result = run_python("import time; time.sleep(60)", SandboxLimits(wall_seconds=1.0), sandbox="unisolated")
    assert result.limit == "wall_time"



def test_cgroup_v2_is_used_where_the_unified_hierarchy_has_memory_and_pids(monkeypatch, tmp_path):
    """This machine's memory controller is cgroup v1, so the v2 layout is checked on a stand-in
    tree: the run's cgroup is made below the caller's, with memory.max, memory.swap.max 0, pids.max."""
    from stages.rl.agents import sandbox_cgroup

    own = tmp_path / "unified" / "user.slice"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").write_text("memory pids\n")
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: {"": str(tmp_path / "unified"), "pids": "/nowhere"})
    monkeypatch.setattr(sandbox_cgroup, "_own_cgroups", lambda: {"": "/user.slice", "pids": "/"})
    monkeypatch.setattr(sandbox_cgroup, "_mkdir", lambda parent, name, exist_ok=False: _stand_in(parent, name))
    cgroup = sandbox_cgroup.make_cgroup(64 << 20, 8)
    assert cgroup.v2 and cgroup.memory == cgroup.pids and Path(cgroup.memory).parent == own
    assert {f: Path(cgroup.memory, f).read_text() for f in ("memory.max", "memory.swap.max", "pids.max")} == {
        "memory.max": str(64 << 20), "memory.swap.max": "0", "pids.max": "8"}


def _stand_in(parent: str, name: str) -> str:
    """A cgroup directory as the kernel makes it: its interface files already there."""
    path = Path(parent, name)
    path.mkdir()
    for interface in ("memory.max", "memory.swap.max", "pids.max", "cgroup.procs"):
        (path / interface).write_text("")
    return str(path)
