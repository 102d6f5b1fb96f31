"""The program a sandboxed run starts with: ``python -I -S -c <this file's text> <config JSON>``.

It is never imported by RayFactory; stages/rl/agents/sandbox.py passes its source to a fresh interpreter
(``-I -S``: no site-packages, no PYTHON* variables, no user directory), so it uses the standard
library only, and stages/rl/agents/sandbox_root.py loaded by path. An isolated run takes three processes,
because each step needs the right one:

    launcher (root, host PID namespace)      reads the code, joins the run's memory and pids
      |                                      cgroups, unshares the mount, PID, network, IPC, UTS
      |                                      and cgroup namespaces
      `-- guard (PID 1 of the new namespace)   builds the minimal root and pivots into it
          `-- worker                         becomes uid/gid 65534 with no capabilities and
                                             no_new_privs, sets the rlimits, runs the code

Fail closed: a step that cannot be done reports ``{"unavailable": "<piece>: <why>"}`` on the status
pipe and the code never runs; the parent refuses the run. User code never runs as PID 1 (the kernel
ignores default-action signals, SIGXCPU among them, sent to a namespace's init). When the worker
ends the guard exits, which kills whatever the worker left behind in the namespace; killing the
launcher's process group (the parent's wall clock) takes the guard down too.

Unisolated (the caller's explicit opt-in) the launcher only forks the worker, which runs the code
with the rlimits in a host directory the parent made, as the caller's uid.
"""

import importlib.util
import json
import os
import resource
import signal
import sys
import traceback

if __name__ != "__main__":  # `python -c` runs it as __main__; an import would run a sandbox setup
    raise ImportError("stages/rl/agents/sandbox_boot.py is the program stages/rl/agents/sandbox.py runs, not a module.")
CONFIG = json.loads(sys.argv[1])
STATUS_FD = CONFIG["status_fd"]
EXITS = CONFIG["exits"]  # the exit codes that name a limit the code ran into
UID = CONFIG["uid"]
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
EFBIG, ENOSPC = 27, 28


def report(message):
    os.write(STATUS_FD, (json.dumps(message) + "\n").encode())


def load_root_module():
    spec = importlib.util.spec_from_file_location("sandbox_root", CONFIG["root_module"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def join_cgroups():
    for cgroup in CONFIG["cgroups"]:
        try:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            raise root.Unavailable(f"cgroup {cgroup}: joining it failed ({exc.strerror})") from None


def drop_privileges():
    """The sandbox user, nothing more: a file it writes is never owned by uid 0, no setuid binary
    can raise it again (no_new_privs, and every mount is nosuid), and it may signal nothing of ours."""
    os.setgroups([])
    os.setresgid(UID, UID, UID)
    os.setresuid(UID, UID, UID)  # from uid 0 to another: the kernel clears every capability
    root.call("no_new_privs", root.libc.prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    kept = {k: status[k].strip() for k in ("CapPrm", "CapEff", "CapAmb") if int(status[k], 16)}
    ids = {int(i) for k in ("Uid", "Gid") for i in status[k].split()}
    if kept or ids != {UID}:
        raise root.Unavailable(f"unprivileged user: ids {sorted(ids)} and capabilities {kept} after dropping to {UID}")


def set_limits(isolated):
    limits = CONFIG["limits"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1))  # SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"], limits["nofile"]))
    if not isolated and hasattr(resource, "RLIMIT_NPROC"):  # isolated, the pids cgroup counts the run alone
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
        status = EXITS["memory"]
        os.write(2, b"MemoryError: the sandbox's memory limit was reached\n")
    except BaseException as exc:
        print_user_traceback(exc)
        status = 1
        if isinstance(exc, OSError) and exc.errno == EFBIG:  # RLIMIT_FSIZE (Python ignores SIGXFSZ)
            status = EXITS["file_size"]
        elif isinstance(exc, OSError) and exc.errno == ENOSPC:  # the work dir's tmpfs is full
            status = EXITS["disk"]
        elif isinstance(exc, BlockingIOError) and exc.filename is None:  # EAGAIN: what a refused fork raises
            status = EXITS["processes"]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)


def worker(code, isolated):
    try:
        if isolated:
            drop_privileges()
        os.chdir(root.WORK if isolated else CONFIG["work_dir"])
        with open("main.py", "wb") as f:
            f.write(code)
    except root.Unavailable as exc:
        report({"unavailable": str(exc)})
        os._exit(EXITS["setup"])
    report({"started": True})
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[1])  # the status pipe and anything inherited
    set_limits(isolated)
    run_user_code()


def wait_for(pid):
    """Wait until ``pid`` ends (as PID 1, reaping the orphans that end meanwhile: a zombie still
    counts against pids.max) and return how it ended and the CPU seconds it used."""
    while True:
        done, status, usage = os.wait4(-1, 0)
        if done == pid:
            break
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status), "cpu": cpu}
    return {"exit": os.WEXITSTATUS(status), "cpu": cpu}


def guard(code):
    """PID 1 of the new namespaces: the minimal root, then the worker; passes its end on."""
    root.libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    root.build(CONFIG["limits"]["disk"], UID, UID)
    root.call("hostname", root.libc.sethostname, b"sandbox", 7)
    pid = os.fork()
    if pid == 0:
        worker(code, isolated=True)
    report(wait_for(pid))
    os._exit(0)


def isolated_run(code):
    join_cgroups()
    root.call("namespaces", root.libc.unshare,
              CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP)
    pid = os.fork()  # the first child after unshare(CLONE_NEWPID) is the namespace's PID 1
    if pid == 0:
        try:
            guard(code)
        except root.Unavailable as exc:
            report({"unavailable": str(exc)})
        except BaseException as exc:  # a setup bug must end the run, not hang it
            report({"error": f"{type(exc).__name__}: {exc}"})
        os._exit(EXITS["setup"])
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main():
    with os.fdopen(CONFIG["code_fd"], "rb") as f:
        code = f.read()
    if not CONFIG["isolated"]:
        pid = os.fork()
        if pid == 0:
            worker(code, isolated=False)
        report(wait_for(pid))
        os._exit(0)
    try:
        isolated_run(code)
    except root.Unavailable as exc:
        report({"unavailable": str(exc)})
        os._exit(EXITS["setup"])


root = load_root_module()
main()
