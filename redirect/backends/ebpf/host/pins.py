"""Where the host part is pinned and what this host offers it: the pin root and the cgroup
(``resolve_root``, ``resolve_cgroup``), bpffs, the host lock (one loader at a time), which pins are
missing (``missing_pins``), removing them all (``unpin_all``), and what the backend needs of the
kernel, bcc and the carried headers (``probe_kernel``, ``host_refusal``).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import re
import stat
from collections.abc import Iterator

from ....errors import BackendUnavailable
from ....kernel import locks
from ...base import ebpf_root
from .objects import CGROUP_PROGRAMS, HEADER_ARCHES, HEADERS_DIR, MAPS, PROGRAMS, build_pin

DEFAULT_CGROUP = "/sys/fs/cgroup/unified"


def resolve_root(root: str | None) -> str:
    """``root``, else the pin root the environment names (``REDIRECT_BPF_ROOT``), else the default."""
    return root or ebpf_root()


def resolve_cgroup(cgroup: str | None) -> str:
    """The cgroup v2 directory the host programs attach to: ``cgroup``, else ``$REDIRECT_BPF_CGROUP``,
    else the cgroup v2 root of the host (``/sys/fs/cgroup/unified`` on a hybrid host, else
    ``/sys/fs/cgroup``). A directory given that is not cgroup v2 but has it as ``unified`` (a hybrid
    host's ``/sys/fs/cgroup``) stands for that child: a container given the node's
    ``/sys/fs/cgroup`` finds the node's cgroup v2 root whatever the node's layout."""
    given = cgroup or os.environ.get("REDIRECT_BPF_CGROUP")
    for c in ((given, os.path.join(given, "unified")) if given else (DEFAULT_CGROUP, "/sys/fs/cgroup")):
        if os.path.isfile(os.path.join(c, "cgroup.controllers")):  # (only cgroup v2 directories have it)
            return c
    return given or DEFAULT_CGROUP


def is_bpffs(path: str) -> bool:
    """Whether ``path`` is on a bpffs mount (``/proc/self/mountinfo``: statfs is not in ``os``)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            mnt = parts[4]
            sep = parts.index("-")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, parts[sep + 1]
    return fstype == "bpf"


def ensure_bpffs(root: str) -> None:
    """bpffs where the pins under ``root`` go (``/sys/fs/bpf`` is mounted when missing), else
    ``BackendUnavailable``."""
    base = "/sys/fs/bpf"
    if root.startswith(base + "/") and not is_bpffs(base):
        import subprocess

        r = subprocess.run(["mount", "-t", "bpf", "bpf", base], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise BackendUnavailable(f"ebpf: bpffs is not mounted at {base} and mounting it failed: {r.stderr.strip()}")
    parent = os.path.dirname(root.rstrip("/"))
    if not is_bpffs(parent if os.path.exists(parent) else base):
        raise BackendUnavailable(f"ebpf: pin root {root!r} is not on a bpffs mount")


#: The directories under the pin root (made by ``make_dirs``).
PIN_DIRS = ("maps", "progs", "links", "pods")


def check_dirs(root: str) -> None:
    """``BackendUnavailable`` unless the pin root and its directories (those there already) are
    directories of this user's (root's) that no other user can write, and not symlinks. On a bpffs
    whose top is writable by every user (the kernel's default mode, 1777), another user could make
    the root first, or a directory under it, and then unpin ours: a cgroup link unpinned is
    detached, and every pod loses capture."""
    me = os.geteuid()
    for path in (root, *(os.path.join(root, d) for d in PIN_DIRS)):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        why = ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory" if not stat.S_ISDIR(st.st_mode)
               else f"is owned by uid {st.st_uid}" if st.st_uid != me
               else f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & 0o022 else None)
        if why:
            raise BackendUnavailable(f"ebpf: pin directory {path} {why}; only this user's own directories, writable by"
                                     " it alone, hold the host pins: remove it (or set REDIRECT_BPF_ROOT elsewhere)")


def make_dirs(root: str) -> None:
    """The pin root and its directories, made if missing with mode 0700 (whatever the umask), and
    checked (``check_dirs``)."""
    for path in (root, *(os.path.join(root, d) for d in PIN_DIRS)):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # (mkdir's mode goes through the umask)
        if path == root:
            check_dirs(root)


def lock_name(root: str) -> str:
    """The host lock's file in the run directory (``redirect.kernel.locks``)."""
    return "ebpf-" + re.sub(r"[^A-Za-z0-9]", "_", root) + ".lock"


@contextlib.contextmanager
def host_lock(root: str) -> Iterator[int]:
    """One loader (or unload) per root at a time, other processes too; the lock file's fd (a process
    it is passed to holds the lock with it)."""
    fd = locks.open_private(lock_name(root))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def missing_pins(root: str, build: str) -> list[str]:
    """The host pins (``maps/x``, ``progs/x``, ``links/x``) not present under ``root``.

    ``maps/build-<build>`` stands for "pinned from these sources" (``objects.build_id``): after an
    upgrade of ``redirect/bpf/`` it is missing, so the old programs are replaced (or, with pods
    registered, setup says so).
    """
    out: list[str] = []
    for d, names in (("maps", (*MAPS, build_pin(build))), ("progs", tuple(PROGRAMS)), ("links", CGROUP_PROGRAMS)):
        try:
            have = set(os.listdir(os.path.join(root, d)))
        except FileNotFoundError:
            have = set()
        out += [f"{d}/{n}" for n in names if n not in have]
    return out


def unpin_all(root: str) -> None:
    """Unpin everything under ``root`` (links first: unpinning the last ref detaches)."""
    for d in ("links", "pods", "progs", "maps"):
        p = os.path.join(root, d)
        if os.path.isdir(p):
            for n in os.listdir(p):
                q = os.path.join(p, n)
                if os.path.isdir(q):  # (<cookie>-tcx: pinned tcx links of an earlier version)
                    for m in os.listdir(q):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(q, m))
                    with contextlib.suppress(OSError):
                        os.rmdir(q)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(q)
            with contextlib.suppress(OSError):
                os.rmdir(p)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def require_cgroup(cgroup: str) -> None:
    if not os.path.isdir(cgroup) or not os.path.exists(os.path.join(cgroup, "cgroup.procs")):
        raise BackendUnavailable(f"ebpf: cgroup v2 not mounted at {cgroup} (set REDIRECT_BPF_CGROUP)")


def probe_kernel() -> None:
    """What the backend needs from this host; ``BackendUnavailable`` names what is missing."""
    rel = os.uname().release
    m = re.match(r"(\d+)\.(\d+)", rel)
    if m and (int(m.group(1)), int(m.group(2))) < (5, 17):
        raise BackendUnavailable(
            f"ebpf: kernel {rel} is too old: needs 5.17+ (sk_lookup ingress_ifindex, netns cookies in sock_ops)"
        )
    why = headers_refusal()
    if why is not None:
        raise BackendUnavailable(why)
    # Found, not imported: bcc (and LLVM with it) is loaded only by the loader process (``.loader``).
    if importlib.util.find_spec("bcc") is None:
        raise BackendUnavailable("ebpf: bcc's Python module is missing (it compiles the host programs once per"
                                 " host): install python3-bpfcc (in a venv: --system-site-packages)")


def headers_refusal() -> str | None:
    """Why the header tree the package carries can't serve bcc on this machine (None: it can)."""
    machine = os.uname().machine
    arch = HEADER_ARCHES.get(machine)
    if arch is None:
        return (f"ebpf: no UAPI headers for this machine's architecture ({machine}) under {HEADERS_DIR}: only"
                f" {', '.join(sorted(HEADER_ARCHES))} is carried")
    for p in ("include/linux/kconfig.h", f"arch/{arch}/include/uapi/asm/types.h"):
        if not os.path.isfile(os.path.join(HEADERS_DIR, p)):
            return f"ebpf: the header tree bcc compiles against is incomplete: {os.path.join(HEADERS_DIR, p)} is" \
                   " missing (an installation without redirect's package data redirect/bpf/headers/)"
    return None


def host_refusal(root: str, cgroup: str) -> str | None:
    """Why this host can't run the backend with pins under ``root`` (None: it can): the kernel,
    bcc, bpffs (mounted where the pins go, or ``/sys/fs/bpf`` there to mount) and cgroup v2. (The
    process asks once per root: ``lifetime.Process.host_refusal``.)"""
    try:
        probe_kernel()
    except BackendUnavailable as e:
        return str(e)
    parent = os.path.dirname(root.rstrip("/"))
    if not (is_bpffs(parent if os.path.exists(parent) else root)
            or (root.startswith("/sys/fs/bpf/") and os.path.isdir("/sys/fs/bpf"))):
        return f"ebpf: no bpffs for the pins under {root}"
    try:
        require_cgroup(cgroup)
    except BackendUnavailable as e:
        return str(e)
    return None


__all__ = ["DEFAULT_CGROUP", "PIN_DIRS", "resolve_root", "resolve_cgroup", "is_bpffs", "ensure_bpffs", "check_dirs",
           "make_dirs", "lock_name", "host_lock",
           "missing_pins", "unpin_all", "require_cgroup", "probe_kernel", "headers_refusal", "host_refusal"]
