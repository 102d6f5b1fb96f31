"""The minimal root a sandboxed run sees, built by its guard (stages/rl/agents/sandbox_boot.py).

Standard library only: the boot program loads this file by path inside a ``python -I -S``
interpreter (it is never imported by RayFactory itself). In the guard's private mount namespace a
small tmpfs becomes the new root; it holds nothing but:

* what the interpreter needs, read-only, at the host's paths (``sys.path`` and the interpreter's
  landmarks are absolute): its standard library (with the prefix's site-packages hidden under an
  empty tmpfs), its executable, the shared objects mapped into it that live outside the system's
  library directories (libpython), the system's library directories themselves (/lib, /usr/lib,
  ...; a symlink such as /lib -> usr/lib stays a symlink) and /etc/ld.so.cache (how the loader
  finds multiarch libraries such as libffi or libssl);
* /dev with null, zero, full, random and urandom only;
* /proc of the run's own PID namespace, ``subset=pid,hidepid=invisible``: the sandbox user's own
  processes, not the host's nor the guard's, and no /proc/sys;
* /tmp, the work directory: a tmpfs of the run's disk size owned by the sandbox user.

So /etc/shadow, /root, /home, /opt, /work (the project checkout), caches and the venv are not
there to be read. Every mount is nosuid and nodev: the five device files are the exception to
nodev (they could not be opened otherwise), and nothing writable allows devices or setuid. The root
tmpfs is read-only. ``pivot_root`` then detaches the host's tree from the namespace altogether, so
unlike chroot there is no way back to it, and the top of the new tree is checked against the plan.
A step the kernel refuses raises ``Unavailable`` naming it: the code must not run.
"""

import ctypes
import os
import platform
import sys
import sysconfig

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MNT_DETACH = 2
SAFE = MS_NOSUID | MS_NODEV
LIB_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32",
            "/usr/local/lib")
LOADER_CACHE = "/etc/ld.so.cache"
DEVICES = ("null", "zero", "full", "random", "urandom")
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # glibc has no pivot_root() wrapper
WORK = "/tmp"
libc = ctypes.CDLL(None, use_errno=True)


class Unavailable(Exception):
    """A piece of the isolation that could not be put in place: the run must not start."""


def call(piece, fn, *args):
    if fn(*args) != 0:
        errno = ctypes.get_errno()
        raise Unavailable(f"{piece}: {os.strerror(errno)} (errno {errno})")


def mount(piece, source, target, fstype, flags, data=None):
    call(piece, libc.mount, source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
         data and data.encode())


def _inside(path, dirs):
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def plan():
    """What the root holds, read from the host before anything is mounted: ``binds`` (host paths,
    directories or files, none inside another), ``links`` ({path: target}) and ``hidden`` dirs."""
    binds, links = [], {}
    for d in LIB_DIRS:
        if os.path.islink(d):
            links[d] = os.readlink(d)
        elif os.path.isdir(d):
            binds.append(d)
    paths = sysconfig.get_paths()
    for p in (paths["stdlib"], paths["platstdlib"], os.path.realpath(sys.executable), *_mapped_files()):
        p = os.path.realpath(p)
        if p == "/":
            raise Unavailable("minimal root: the interpreter lives at /, which would expose the whole filesystem")
        if not _inside(p, binds):
            binds = [b for b in binds if not _inside(b, [p])] + [p]
    if os.path.isfile(LOADER_CACHE):
        binds.append(LOADER_CACHE)
    hidden = sorted({os.path.realpath(paths[k]) for k in ("purelib", "platlib")
                     if os.path.isdir(paths[k]) and _inside(os.path.realpath(paths[k]), binds)})
    return sorted(binds), links, hidden


def _mapped_files():
    """Files mapped into this interpreter (libpython, the loader, extension modules) that the
    system's library directories do not already hold."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/") and not parts[5].rstrip().endswith("(deleted)"):
                found.add(parts[5].rstrip("\n"))
    return sorted(p for p in found if os.path.isfile(p) and not _inside(os.path.realpath(p), LIB_DIRS))


def _make_target(root, path, is_dir):
    target = root + path
    os.makedirs(target if is_dir else os.path.dirname(target), mode=0o755, exist_ok=True)
    if not is_dir:
        open(target, "a").close()
    return target


def _bind(piece, source_fd, target, flags):
    mount(piece, f"/proc/self/fd/{source_fd}", target, None, MS_BIND)
    mount(piece, None, target, None, MS_BIND | MS_REMOUNT | flags)


def build(disk_bytes, uid, gid, new_root="/tmp"):
    """Build the root (in the calling process's fresh mount and PID namespaces) and pivot into it."""
    binds, links, hidden = plan()
    mount("private mounts", None, "/", None, MS_REC | MS_PRIVATE)  # nothing below reaches the host
    # O_PATH descriptors first: mounting the new root over /tmp hides whatever lies under it.
    sources = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in binds + [f"/dev/{d}" for d in DEVICES]}
    root = os.path.realpath(new_root)
    mount("minimal root", "tmpfs", root, "tmpfs", SAFE, "size=1m,mode=755")
    for path in binds:
        is_dir = os.path.isdir(f"/proc/self/fd/{sources[path]}")
        _bind(f"read-only bind of {path}", sources[path], _make_target(root, path, is_dir), MS_RDONLY | SAFE)
    for path in hidden:
        mount(f"hiding {path}", "tmpfs", root + path, "tmpfs", MS_RDONLY | SAFE | MS_NOEXEC, "size=4k,mode=755")
    for path, target in links.items():
        os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
        os.symlink(target, root + path)
    _devices(root, sources)
    for fd in sources.values():
        os.close(fd)
    _proc(root + "/proc")
    work = _make_target(root, WORK, True)
    mount("size-limited work dir", "tmpfs", work, "tmpfs", SAFE | MS_NOEXEC,
          f"size={disk_bytes},nr_inodes=4096,mode=700,uid={uid},gid={gid}")
    os.chdir(root)
    call("pivot_root", libc.syscall, _pivot_root_number(), b".", b".")
    call("detaching the host's tree", libc.umount2, b".", MNT_DETACH)
    os.chdir("/")
    mount("read-only root", None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | SAFE)
    expected = {p.split("/")[1] for p in [*binds, *links, "/dev", "/proc", WORK]}
    if set(os.listdir("/")) != expected:
        raise Unavailable(f"minimal root: / holds {sorted(os.listdir('/'))}, not {sorted(expected)}")


def _devices(root, sources):
    dev = _make_target(root, "/dev", True)
    mount("/dev", "tmpfs", dev, "tmpfs", SAFE | MS_NOEXEC, "size=4k,mode=755")
    for d in DEVICES:  # writable (/dev/null must be) and, alone of all mounts, without nodev
        _bind(f"/dev/{d}", sources[f"/dev/{d}"], _make_target(root, f"/dev/{d}", False), MS_NOSUID | MS_NOEXEC)
    mount("/dev", None, dev, None, MS_BIND | MS_REMOUNT | MS_RDONLY | SAFE | MS_NOEXEC)


def _proc(target):
    os.makedirs(target, mode=0o755)
    flags = SAFE | MS_NOEXEC
    try:  # only the sandbox user's processes, and no /proc/sys (Linux 5.8+)
        mount("/proc", "proc", target, "proc", flags, "subset=pid,hidepid=invisible")
    except Unavailable:  # an older kernel: the PID namespace still hides every host process
        mount("/proc", "proc", target, "proc", flags)


def _pivot_root_number():
    machine = platform.machine()
    if machine not in SYS_PIVOT_ROOT:
        raise Unavailable(f"pivot_root: its system call number on {machine} is not known here")
    return SYS_PIVOT_ROOT[machine]
