"""The Python sandbox against what escapes are made of: each run is stopped, and by the limit it names.

Every claim in ``result.enforced`` is checked against what the code actually managed: a test fails
when the sandbox says a protection holds and the code got through anyway. The fork bomb is safe to
run as root (where RLIMIT_NPROC does not apply): it is capped by the run's pids cgroup when there is
one, and otherwise ended by the wall-clock kill of the whole PID namespace / process group.
"""

import os
import socket
import sys
import textwrap
import time
import uuid

import pytest

from stages.rl.sandbox import SandboxLimits, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's limits are Linux's")

FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=1, memory_bytes=256 << 20, max_output_bytes=64 * 1024,
                     file_size_bytes=1 << 20, max_processes=16)


def run(code: str, limits: SandboxLimits = FAST):
    return run_python(textwrap.dedent(code), limits)


def test_a_normal_computation_returns_its_answer():
    result = run("""
        import math
        print(sum(i * i for i in range(1, 101)), math.factorial(20))
    """)
    assert result.ok and result.limit is None
    assert result.stdout.split() == ["338350", "2432902008176640000"]
    assert result.elapsed < 3


def test_exceptions_and_exit_codes_come_back():
    result = run("import sys\nprint('before')\nsys.exit(3)")
    assert (result.exit_code, result.limit, result.stdout) == (3, None, "before\n")
    result = run("raise KeyError('boom')")
    assert result.exit_code == 1 and "KeyError: 'boom'" in result.stderr


def test_an_infinite_loop_is_stopped_by_cpu_time():
    result = run("while True: pass")
    assert result.limit == "cpu_time" and result.exit_code == -24  # SIGXCPU
    assert result.elapsed < FAST.wall_seconds


def test_a_sleeper_is_stopped_by_wall_clock():
    result = run("import time; time.sleep(60)", SandboxLimits(wall_seconds=1.0))
    assert result.limit == "wall_time" and result.exit_code is None
    assert result.elapsed < 2


def test_a_memory_hog_is_stopped_by_the_address_space_limit():
    result = run("blocks = []\nwhile True: blocks.append(bytearray(16 << 20))")
    assert result.limit == "memory"
    assert "MemoryError" in result.stderr


def test_a_100_mb_print_is_cut_at_the_output_cap():
    result = run("import sys\nsys.stdout.write('x' * (100 << 20))", SandboxLimits(memory_bytes=1 << 30))
    assert result.limit == "output" and result.truncated
    assert len(result.stdout) + len(result.stderr) <= FAST.max_output_bytes
    assert result.elapsed < 3


def test_a_big_file_is_stopped_by_the_file_size_limit():
    result = run("open('big', 'wb').write(b'a' * (4 << 20))")
    assert result.limit == "file_size"


def _marker() -> str:
    return "rf" + uuid.uuid4().hex[:12]  # a process name (comm) holds 15 characters


NAME_ITSELF = "import ctypes; ctypes.CDLL(None).prctl(15, MARKER.encode())  # PR_SET_NAME, inherited by forks"


def _processes_named(marker: str) -> list[str]:
    """Host processes whose name is ``marker``: what a run left behind."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == marker:
                    found.append(pid)
        except OSError:
            pass
    return found


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind():
    marker = _marker()
    code = f"""
        import os
        MARKER = {marker!r}
        {NAME_ITSELF}
        while True:
            os.fork()
    """
    result = run(code)
    if result.enforced.get("processes_cgroup"):
        assert result.limit == "processes" and result.processes_capped
        assert "BlockingIOError" in result.stderr  # fork() refused: EAGAIN from pids.max
    else:  # no pids cgroup here: the wall clock ends it (RLIMIT_NPROC does not bind root)
        assert result.limit in ("processes", "wall_time")
    assert result.elapsed < FAST.wall_seconds + 1
    time.sleep(0.2)
    assert _processes_named(marker) == []  # the whole namespace / group is gone


def test_a_fork_bomb_that_survives_failed_forks_ends_at_the_wall_clock():
    marker = _marker()
    code = f"""
        import os
        MARKER = {marker!r}
        {NAME_ITSELF}
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    result = run(code, SandboxLimits(wall_seconds=1.5, cpu_seconds=5, max_processes=16))
    assert result.limit == "wall_time"
    if result.enforced.get("processes_cgroup"):
        assert result.processes_capped
    time.sleep(0.2)
    assert _processes_named(marker) == []


def test_a_background_process_dies_with_the_run():
    marker = _marker()
    code = f"""
        import os, time
        MARKER = {marker!r}
        {NAME_ITSELF}
        if os.fork() == 0:
            os.setsid()  # leaves the process group: only the PID namespace or the cgroup catch it
            time.sleep(30)
        print("parent done")
    """
    result = run(code)
    assert result.ok and result.stdout == "parent done\n", result.stderr
    time.sleep(0.2)
    if result.enforced.get("pid_namespace") or result.enforced.get("processes_cgroup"):
        assert _processes_named(marker) == []


def test_a_write_outside_the_work_dir(tmp_path):
    outside = tmp_path / "escaped.txt"
    home = f"/root/rayfactory-sandbox-escape-{uuid.uuid4().hex}"  # on the root filesystem, not in /tmp
    code = f"""
        import os
        results = []
        for path in ({str(outside)!r}, {home!r}):
            try:
                with open(path, "w") as f:
                    f.write("escaped")
                results.append("written")
            except OSError as exc:
                results.append(type(exc).__name__ + ":" + str(exc.errno))
        open("inside.txt", "w").write("ok")  # its own directory stays writable
        print(" ".join(results), open("inside.txt").read())
    """
    try:
        result = run(code)
        assert result.ok, result.stderr
        if result.enforced.get("filesystem_readonly"):
            # /tmp is an empty tmpfs (ENOENT: the test's directory is not even visible); / is read-only (EROFS)
            assert result.stdout.split() == ["FileNotFoundError:2", "OSError:30", "ok"]
            assert not outside.exists() and not os.path.exists(home)
        else:  # not enforced here: the sandbox must say so, and the write went through
            assert "written" in result.stdout
    finally:
        for path in (str(outside), home):
            if os.path.exists(path):
                os.remove(path)


def test_an_outbound_connection(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    code = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
            print("connected")
        except OSError as exc:
            print("refused", exc.errno)
    """
    try:
        result = run(code)
    finally:
        listener.close()
    assert result.ok, result.stderr
    if result.enforced.get("network"):
        assert result.stdout.startswith("refused")  # ENETUNREACH: the namespace's loopback is down
    else:
        assert result.stdout == "connected\n"


def test_no_environment_and_no_capabilities():
    os.environ["RAYFACTORY_SANDBOX_SECRET"] = "s3cret"
    try:
        result = run("""
            import os, resource, ctypes
            print(sorted(k for k in os.environ if k != "LC_CTYPE"))  # LC_CTYPE: Python's own C-locale coercion
            try:
                resource.setrlimit(resource.RLIMIT_CPU, (100, 100))
                print("raised")
            except ValueError:
                print("kept")
            libc = ctypes.CDLL(None, use_errno=True)
            print("remount", libc.mount(None, b"/", None, 4096 | 32, None))  # MS_BIND | MS_REMOUNT: rw again
        """)
    finally:
        del os.environ["RAYFACTORY_SANDBOX_SECRET"]
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "['PATH']"
    assert lines[1] == "kept"  # the hard limit cannot be raised
    if result.enforced.get("no_capabilities"):
        assert lines[2] == "remount -1"


def test_concurrent_runs_are_independent_and_leave_no_files_or_cgroups():
    from concurrent.futures import ThreadPoolExecutor
    import glob
    import tempfile

    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rayfactory-sandbox-*")))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run(f"print({i} * {i})"), range(8)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "rayfactory-sandbox-*"))) == before
    assert not glob.glob("/sys/fs/cgroup/*/rayfactory-sandbox-*") + glob.glob("/sys/fs/cgroup/rayfactory-sandbox-*")
