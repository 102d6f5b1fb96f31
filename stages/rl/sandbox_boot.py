"""The program a sandboxed run starts with: ``python -I -S -c <this file's text> <config JSON>``.

It is never imported by RayFactory; stages/rl/sandbox.py passes its source to a fresh interpreter
(``-I -S``: no site-packages, no PYTHON* variables, no user directory), so it may use the standard
library only. It builds the isolation in three processes, because each step needs the right one:

    launcher (our pid, host PID namespace)   joins the pids cgroup, unshares mount/net/PID/IPC
      `-- guard (PID 1 of the new namespace)   mounts a private /proc, hides /tmp-like dirs, binds the
          |                                    work dir, remounts everything else read-only, reports
          `-- worker                           drops capabilities (a new user namespace), sets the
                                               rlimits, closes the status pipe, runs the user's code

User code never runs as PID 1 (the kernel ignores default-action signals such as SIGXCPU sent to a
namespace's init). When the worker ends the guard exits, which kills whatever the worker left behind
in the namespace; when the launcher dies the guard gets SIGKILL (PR_SET_PDEATHSIG), so killing the
launcher's process group tears everything down. Every step that the platform refuses is recorded as
not enforced in the JSON status line (never assumed): the parent reports exactly that.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

if __name__ != "__main__":  # `python -c` runs it as __main__; an import would run a sandbox setup
    raise ImportError("stages/rl/sandbox_boot.py is the program stages/rl/sandbox.py runs, not a module.")
CONFIG = json.loads(sys.argv[1])
STATUS_FD = CONFIG["status_fd"]
MEMORY_EXIT, FILE_SIZE_EXIT, SETUP_EXIT = CONFIG["memory_exit"], CONFIG["file_size_exit"], CONFIG["setup_exit"]
PROCESSES_EXIT = CONFIG["processes_exit"]
WORK = "/tmp/work"  # where the work dir appears inside a private mount namespace

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
HIDDEN = ("/tmp", "/var/tmp", "/run", "/dev/shm")  # world-writable or socket dirs: an empty tmpfs over each
enforced = {"processes_cgroup": False, "pid_namespace": False, "network": False, "filesystem_readonly": False,
            "private_tmp": False, "no_capabilities": False}
notes = []
libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def report(message):
    os.write(STATUS_FD, (json.dumps(message) + "\n").encode())


def call(fn, *args):
    if fn(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def mount(source, target, fstype, flags, data=None):
    call(libc.mount, source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
         data and data.encode())


def join_cgroup():
    if CONFIG["cgroup"]:
        try:
            with open(os.path.join(CONFIG["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            enforced["processes_cgroup"] = True
        except OSError as exc:
            notes.append(f"pids cgroup not joined: {exc}")


def map_to_root():
    """A caller that is not root first becomes root of its own user namespace, to own the others."""
    uid, gid = os.getuid(), os.getgid()
    call(libc.unshare, CLONE_NEWUSER)
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                       ("/proc/self/gid_map", f"0 {gid} 1")):
        with open(path, "w") as f:
            f.write(text)


def unshare_namespaces():
    if libc is None:
        notes.append("not Linux: no namespaces")
        return False
    try:
        if os.geteuid() != 0:
            map_to_root()
        call(libc.unshare, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC)
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks back to the host
        return True
    except OSError as exc:
        notes.append(f"namespaces refused ({exc}): no network, PID or filesystem isolation")
        return False


def mount_points():
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
            points.append((point, fields[5].split(",")))
    return points


def isolate_filesystem(work_fd):
    """A private /proc and /tmp, the work dir at WORK, every other mount read-only."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    hidden = [d for d in HIDDEN if os.path.isdir(d) and not os.path.islink(d)]
    for d in hidden:
        mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    os.makedirs(WORK, exist_ok=True)
    mount(f"/proc/self/fd/{work_fd}", WORK, None, MS_BIND)
    enforced["private_tmp"] = "/tmp" in hidden
    failed = []
    for point, options in mount_points():
        if point == WORK:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for option in options:
            flags |= MOUNT_FLAGS.get(option, 0)
        try:
            mount(None, point, None, flags)
        except OSError as exc:
            failed.append(f"{point} ({exc.strerror})")
    enforced["filesystem_readonly"] = not failed
    if failed:
        notes.append("left writable: " + ", ".join(failed))


def set_limits():
    limits = CONFIG["limits"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"], limits["nofile"]))
    if hasattr(resource, "RLIMIT_NPROC"):
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))  # last: setup may allocate


def print_user_traceback(exc):
    """The traceback from the user's main.py down, without this program's frame."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    traceback.print_exception(type(exc), exc, tb)


def run_user_code():
    """The worker's last act: run main.py and exit with its status; never returns. A limit that
    surfaces as an exception exits with that limit's own code, so the parent can name it."""
    status = 0
    try:
        with open("main.py") as f:
            code = compile(f.read(), "main.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except MemoryError:
        status = MEMORY_EXIT
        os.write(2, b"MemoryError: the sandbox's memory limit was reached\n")
    except BaseException as exc:
        print_user_traceback(exc)
        status = 1
        if isinstance(exc, OSError) and exc.errno == 27:  # EFBIG: RLIMIT_FSIZE (Python ignores SIGXFSZ)
            status = FILE_SIZE_EXIT
        elif isinstance(exc, BlockingIOError) and exc.filename is None:  # EAGAIN: what a refused fork raises
            status = PROCESSES_EXIT
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)


def worker():
    try:
        if libc is not None and enforced["pid_namespace"]:
            # Caps in the host's user namespace go: no remount, no raising hard rlimits, no mounts.
            call(libc.unshare, CLONE_NEWUSER)
            enforced["no_capabilities"] = True
    except OSError as exc:
        notes.append(f"capabilities kept: user namespace refused ({exc})")
    set_limits()
    report({"enforced": enforced, "notes": notes})
    os.close(STATUS_FD)
    run_user_code()


def wait_status(pid):
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"exit": os.WEXITSTATUS(status)}


def guard(work_dir):
    """PID 1 of the new namespace: set up the filesystem, start the worker, pass its status on."""
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the launcher's death takes the namespace down
    enforced["pid_namespace"] = True
    enforced["network"] = True  # the net namespace holds only a loopback device that is down
    work_fd = os.open(work_dir, os.O_RDONLY)
    try:
        isolate_filesystem(work_fd)
        os.chdir(WORK)
    except OSError as exc:
        notes.append(f"filesystem isolation refused ({exc})")
        os.chdir(work_dir)
    os.close(work_fd)
    pid = os.fork()
    if pid == 0:
        worker()
        os._exit(0)
    report(wait_status(pid))
    os._exit(0)


def main():
    os.chdir(CONFIG["work_dir"])
    join_cgroup()
    if unshare_namespaces():
        pid = os.fork()  # the first child after unshare(CLONE_NEWPID) is the namespace's PID 1
        if pid == 0:
            try:
                guard(CONFIG["work_dir"])
            except BaseException as exc:  # a setup bug must end the run, not hang it
                report({"error": f"{type(exc).__name__}: {exc}"})
                os._exit(SETUP_EXIT)
        guard_status = wait_status(pid)  # 0 once the guard reported the worker's end; else it was killed
        os._exit(guard_status.get("exit", 128 + guard_status.get("signal", 0)))
    pid = os.fork()  # no namespaces: the worker is still a child, so its status is reported alike
    if pid == 0:
        worker()
        os._exit(0)
    report(wait_status(pid))
    os._exit(0)


main()
