"""The Python sandbox's limits: each run is stopped by the limit it names (CPU time, wall clock,
memory, output, file size, work-dir size, processes), and nothing it started outlives it.

As in test_sandbox.py (the isolation attacks and the refusals), the runs are isolated: where this
machine cannot isolate a run they skip with the missing piece, except under CI=true (tests/ci.py).
"""

import os
import textwrap
import time
import uuid
from dataclasses import replace

from stages.rl.agents import sandbox
from stages.rl.agents.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=1, memory_bytes=256 << 20, max_output_bytes=64 * 1024,
                     file_size_bytes=1 << 20, disk_bytes=8 << 20, max_processes=16)


def run(code: str, limits: SandboxLimits = FAST):
    return run_python(textwrap.dedent(code), limits)


def test_a_normal_computation_returns_its_answer(isolated):
    result = run("""
        import math
        print(sum(i * i for i in range(1, 101)), math.factorial(20))
    """)
    assert result.ok and result.limit is None and result.stopped == ""
    assert result.stdout.split() == ["338350", "2432902008176640000"]
    assert result.enforced == {piece: True for piece in sandbox.PIECES}
    assert result.elapsed < 3


def test_exceptions_and_exit_codes_come_back(isolated):
    result = run("import sys\nprint('before')\nsys.exit(3)")
    assert (result.exit_code, result.limit, result.stdout) == (3, None, "before\n")
    result = run("raise KeyError('boom')")
    assert result.exit_code == 1 and "KeyError: 'boom'" in result.stderr


CPU_BOUND = replace(FAST, wall_seconds=15.0)  # CPU seconds, not wall: a loaded machine gives less than a core


def test_an_infinite_loop_is_stopped_by_cpu_time(isolated):
    result = run("while True: pass", CPU_BOUND)
    assert result.limit == "cpu_time" and result.exit_code == -24  # SIGXCPU
    assert result.stopped == "[stopped: the CPU-time limit (1 s)]"


def test_a_loop_that_ignores_sigxcpu_is_still_stopped_by_cpu_time(isolated):
    result = run("""
        import signal
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        while True: pass
    """, CPU_BOUND)
    assert result.exit_code == -9 and result.limit == "cpu_time"  # the hard limit's SIGKILL, a second later
    assert result.stopped == "[stopped: the CPU-time limit (1 s)]"


def test_a_sleeper_is_stopped_by_wall_clock(isolated):
    result = run("import time; time.sleep(60)", SandboxLimits(wall_seconds=1.0))
    assert result.limit == "wall_time" and result.exit_code is None
    assert result.stopped == "[stopped: the wall-clock limit (1 s)]"
    assert result.elapsed < 2


def test_a_memory_hog_is_stopped_by_the_memory_limit(isolated):
    result = run("blocks = []\nwhile True: blocks.append(bytearray(16 << 20))")
    assert result.limit == "memory" and "MemoryError" in result.stderr
    assert result.stopped == "[stopped: the memory limit (256 MiB for all its processes together)]"


def test_a_forking_tree_is_capped_by_its_total_memory(isolated):
    """8 children of 60 MiB each (480 MiB), under a 256 MiB limit that each one alone stays below:
    the run's memory cgroup kills some of them, and the run says so."""
    result = run("""
        import os, time
        children = []
        for _ in range(8):
            pid = os.fork()
            if pid == 0:
                block = bytearray(60 << 20)  # zero-filled: every page touched
                time.sleep(1.5)
                os._exit(0)
            children.append(pid)
        print(" ".join(str(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])) for pid in children))
    """, SandboxLimits(wall_seconds=6.0, cpu_seconds=2, memory_bytes=256 << 20, max_processes=16))
    codes = [int(c) for c in result.stdout.split()]
    assert len(codes) == 8 and codes.count(-9) >= 3, result.stdout  # at most 4 x 60 MiB fit with the parent
    assert result.limit == "memory"
    assert result.stopped == "[stopped: the memory limit (256 MiB for all its processes together)]"


def test_a_100_mb_print_is_cut_at_the_output_cap(isolated):
    result = run("import sys\nsys.stdout.write('x' * (100 << 20))", SandboxLimits(memory_bytes=1 << 30))
    assert result.limit == "output" and result.truncated
    assert len(result.stdout) + len(result.stderr) <= FAST.max_output_bytes
    assert result.stopped == "[stopped: the output limit (64 KiB)]"
    assert result.elapsed < 3


def test_a_big_file_is_stopped_by_the_file_size_limit(isolated):
    result = run("open('big', 'wb').write(b'a' * (4 << 20))")
    assert result.limit == "file_size"
    assert result.stopped == "[stopped: the file-size limit (1 MiB per file)]"


def test_filling_the_work_dir_is_stopped_by_its_size(isolated):
    """Files each under the file-size limit, 8 MiB of them in all: the work dir's tmpfs is full."""
    result = run("""
        for i in range(1000):
            with open(f"part{i}", "wb") as f:
                f.write(b"a" * (512 << 10))
    """)
    assert result.limit == "disk" and "No space left on device" in result.stderr
    assert result.stopped == "[stopped: disk full: the work directory's size limit (8 MiB)]"


def _marker() -> str:
    return "rf" + uuid.uuid4().hex[:12]  # a process name (comm) holds 15 characters


NAME_ITSELF = "import ctypes; ctypes.CDLL(None).prctl(15, MARKER.encode())  # PR_SET_NAME, inherited by forks"


def _processes_named(marker: str) -> list[str]:
    """Host processes whose name is ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == marker:
                    found.append(pid)
        except OSError:
            pass
    return found


def test_a_fork_bomb_is_capped_by_the_process_limit_and_leaves_nothing_behind(isolated):
    marker = _marker()
    result = run(f"""
        import os
        MARKER = {marker!r}
        {NAME_ITSELF}
        while True:
            os.fork()
    """)
    assert result.limit == "processes" and result.processes_capped
    assert "BlockingIOError" in result.stderr  # fork() refused: EAGAIN from pids.max
    assert result.stopped == "[stopped: the process limit (16 processes)]"
    assert result.elapsed < FAST.wall_seconds + 1
    time.sleep(0.2)
    assert _processes_named(marker) == []


def test_a_fork_bomb_that_survives_failed_forks_ends_at_the_wall_clock(isolated):
    marker = _marker()
    result = run(f"""
        import os
        MARKER = {marker!r}
        {NAME_ITSELF}
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, SandboxLimits(wall_seconds=1.5, cpu_seconds=5, max_processes=16))
    assert result.limit == "wall_time" and result.processes_capped
    time.sleep(0.2)
    assert _processes_named(marker) == []


def test_a_background_process_dies_with_the_run(isolated):
    marker = _marker()
    result = run(f"""
        import os, time
        MARKER = {marker!r}
        {NAME_ITSELF}
        if os.fork() == 0:
            os.setsid()  # leaves the process group: only the PID namespace or the cgroup catch it
            time.sleep(30)
        print("parent done")
    """)
    assert result.ok and result.stdout == "parent done\n", result.stderr
    time.sleep(0.2)
    assert _processes_named(marker) == []
