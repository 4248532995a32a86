"""The run directory and the locks in it.

Every lock (and any other file redirect keeps at run time) lives in one directory,
``/run/redirect`` (``REDIRECT_RUN_DIR`` names another, e.g. a host path mounted into a
container). Root writes there while unprivileged users may be on the node, so the directory
must be a real directory (not a symlink) owned by root (or by the user redirect runs as) and
writable by its owner alone; it is created ``0700`` when missing. Files in it are opened
relative to the checked directory with ``O_NOFOLLOW`` and must be regular files of the same
owner that no one else may read or write. Anything else is refused with ``SetupError`` naming
the path and what is wrong: redirect never falls back to a weaker lock.

The netns lock: threads and processes (the CNI plugin, the agent, ``redirect init``, a
user's) take one byte of ``netns.lock``, at the netns inode's offset, while they change that
netns: no lock file per pod to clean up. The lock is an OFD lock (``F_OFD_SETLK``), which
belongs to an open file description: each thread opens the file for itself, so one lock keeps
out other threads and other processes alike. The eBPF backend's fresh-pod call
(native/pod_setup.c) takes the same lock on the fd :func:`thread_lock_fd` gives it.

The netfilter marks: a setup of a netfilter backend marks its netns first, with the netns's
cookie in 8 bytes of ``netfilter.cookies`` at 8 times the netns inode (:func:`mark_netfilter`),
so that the eBPF backend's setup of a new pod knows without asking the kernel that no netfilter
capture of ours can be there (one netns never holds two backends' capture). Inodes are reused
as pods come and go; cookies never are: a mark with another netns's cookie is stale, and says
nothing of this one. Capture installed before the file existed (by an earlier version) was not
marked: whoever makes the file first marks every netns there is then (the netns of every
process, and those bind-mounted, as ``/run/netns`` entries are) as unknown (all ones: its
tables are looked at), then writes its header (``MARKS_READY`` in its first 8 bytes); until then
no one trusts a missing mark. A teardown of every backend's capture (``redirect.teardown``
without a backend) clears the mark (:func:`unmark_netfilter`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator

from ..errors import SetupError

log = logging.getLogger("redirect")

#: Where locks and run-time state live, unless ``REDIRECT_RUN_DIR`` names another directory.
RUN_DIR = "/run/redirect"
#: The netns lock file, in the run directory.
NETNS_LOCK = "netns.lock"
LOCK_WAIT_S = 30.0


def run_dir_path() -> str:
    """The run directory's path (not checked: see :func:`open_run_dir`)."""
    return os.environ.get("REDIRECT_RUN_DIR") or RUN_DIR


def _owners() -> tuple[int, ...]:
    euid = os.geteuid()
    return (0,) if euid == 0 else (0, euid)


def _refuse(path: str, what: str) -> SetupError:
    return SetupError(f"{path}: {what}; redirect keeps its locks and records there and needs them owned by root"
                      f" and writable by root alone (a directory of mode 0700, files of mode 0600, no symlinks)."
                      f" Remove or fix it (or name another directory with REDIRECT_RUN_DIR)")


def _vetted(fd: int, path: str, regular: bool, mode_mask: int, mode_text: str) -> int:
    """``fd`` if what it opened (``path``) is a regular file (where ``regular``), owned by root or
    us, with none of ``mode_mask`` set; else ``fd`` is closed and ``SetupError`` raised."""
    st = os.fstat(fd)
    why = None
    if regular and not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_uid not in _owners():
        why = f"is owned by uid {st.st_uid}"
    elif st.st_mode & mode_mask:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o} ({mode_text})"
    if why is not None:
        os.close(fd)
        raise _refuse(path, why)
    return fd


def open_run_dir() -> int:
    """An fd (``O_PATH``-like, read-only) of the checked run directory, made ``0700`` if missing."""
    path = run_dir_path()
    for attempt in range(2):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            break
        except FileNotFoundError:
            if attempt:
                raise _refuse(path, "vanished while being created") from None
            parent = os.path.dirname(path.rstrip("/")) or "/"
            try:
                os.makedirs(parent, mode=0o755, exist_ok=True)
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass  # made by another process at the same time: checked below like any other
            except OSError as e:
                raise _refuse(path, f"cannot be created: {e.strerror}") from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _refuse(path, "is a symlink or not a directory") from None
            raise _refuse(path, f"cannot be opened: {e.strerror}") from None
    return _vetted(fd, path, regular=False, mode_mask=0o022, mode_text="writable by group or others")


def open_private(name: str) -> int:
    """Open (creating ``0600``) the file ``name`` in the run directory for reading and writing,
    after checking the directory and the file (see the module docstring)."""
    dfd = open_run_dir()
    path = os.path.join(run_dir_path(), name)
    try:
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:
            what = "is a symlink" if e.errno == errno.ELOOP else f"cannot be opened: {e.strerror}"
            raise _refuse(path, what) from None
    finally:
        os.close(dfd)
    return _vetted(fd, path, regular=True, mode_mask=0o077, mode_text="open to group or others")


def open_private_dir(name: str) -> int:
    """An fd of the directory ``name`` in the run directory, made ``0700`` if missing, after
    checking the run directory and it: a real directory (not a symlink) of the run directory's
    owners that no one else may read, write or enter. ``SetupError`` naming it otherwise."""
    dfd = open_run_dir()
    path = os.path.join(run_dir_path(), name)
    try:
        for attempt in range(2):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                break
            except FileNotFoundError:
                if attempt:
                    raise _refuse(path, "vanished while being created") from None
                with contextlib.suppress(FileExistsError):  # (made meanwhile: checked like any other)
                    os.mkdir(name, 0o700, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(path, "is a symlink or not a directory") from None
                raise _refuse(path, f"cannot be opened: {e.strerror}") from None
    finally:
        os.close(dfd)
    return _vetted(fd, path, regular=False, mode_mask=0o077, mode_text="open to group or others")


def check_private_file(fd: int, path: str) -> int:
    """``fd`` if the file it opened (``path``) is a regular file of the run directory's owners that
    no one else may read or write; else ``fd`` is closed and ``SetupError`` raised."""
    return _vetted(fd, path, regular=True, mode_mask=0o077, mode_text="open to group or others")


class _LockFile:
    """One thread's own open of the netns lock file, closed with the thread's locals."""

    __slots__ = ("fd", "gen")

    def __init__(self, fd: int, gen: int) -> None:
        self.fd, self.gen = fd, gen

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            os.close(self.fd)


_tls = threading.local()
#: Bumped in a forked child: the child's threads open the file anew (a description shared with
#: the parent would share its locks, not contend for them).
_fork_gen = 0


def _after_fork_in_child() -> None:
    global _fork_gen
    _fork_gen += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def thread_lock_fd() -> int:
    """This thread's own fd of the netns lock file (opened and checked on first use).
    ``SetupError`` if the run directory or the file is not as it must be."""
    lf = getattr(_tls, "lock_file", None)
    if lf is not None and lf.gen == _fork_gen:
        return int(lf.fd)
    fd = open_private(NETNS_LOCK)
    _tls.lock_file = _LockFile(fd, _fork_gen)
    return fd


#: The marks file's name, in the run directory, and its header once complete.
NETFILTER_MARKS = "netfilter.cookies"
MARKS_READY = b"rdrmark2"
#: A mark of a netns that was there when the marks were made: may hold netfilter capture of ours.
MARK_UNKNOWN = (1 << 64) - 1
#: The marks file of earlier versions (a byte per netns inode), removed when these are made.
_OLD_MARKS = "netfilter.marks"
_marks: tuple[int, bool, int] | None = None  # (fd, ready, pid)
_marks_lock = threading.Lock()
_MARK = struct.Struct("=Q")  # (native order: native/pod_setup.c reads it)


def netfilter_marks() -> tuple[int, bool]:
    """(fd, ready) of the netfilter marks (module docstring), opened once per process; the first
    process to find them without their header marks every netns there is, then writes it."""
    global _marks
    m = _marks
    if m is not None and m[2] == os.getpid() and m[1]:
        return m[0], m[1]
    with _marks_lock:
        fd = _marks[0] if _marks is not None and _marks[2] == os.getpid() else open_private(NETFILTER_MARKS)
        ready = os.pread(fd, len(MARKS_READY), 0) == MARKS_READY
        if not ready:  # (two processes at once both mark: the same marks)
            for inode in _existing_netns():
                os.pwrite(fd, _MARK.pack(MARK_UNKNOWN), inode * _MARK.size)
            os.pwrite(fd, MARKS_READY, 0)
            ready = True
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(run_dir_path(), _OLD_MARKS))
        # Reads leave the file's atime alone: each fresh eBPF pod's setup reads its mark, and an
        # atime update costs that read about as much again (docs/kernel-facts.md).
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NOATIME)
        _marks = (fd, ready, os.getpid())
        return fd, ready


def _existing_netns() -> set[int]:
    """The inodes of the network namespaces there are now: those of the processes, and those
    bind-mounted (``nsfs`` mounts, ``/run/netns`` and the like)."""
    out: set[int] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                out.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            root = line.split(" ", 4)[3]  # an nsfs mount's root names its namespace: net:[4026532281]
            if root.startswith("net:[") and root.endswith("]") and root[5:-1].isdigit():
                out.add(int(root[5:-1]))
    return {i for i in out if i >= 1}  # (inode 0 would be the header)


def netfilter_mark(inode: int) -> int:
    """The mark of the netns ``inode``: 0 (none), a netns cookie, or ``MARK_UNKNOWN``."""
    fd, _ready = netfilter_marks()
    raw = os.pread(fd, _MARK.size, inode * _MARK.size)
    return _MARK.unpack(raw)[0] if len(raw) == _MARK.size else 0


def mark_netfilter(inode: int, cookie: int) -> None:
    """Mark the netns ``inode`` (its cookie ``cookie``) as one that may hold netfilter capture of
    ours (before it does)."""
    fd, _ready = netfilter_marks()
    os.pwrite(fd, _MARK.pack(cookie), inode * _MARK.size)


def unmark_netfilter(inode: int) -> None:
    """Clear the mark of the netns ``inode``: it holds no netfilter capture of ours (its caller
    holds the netns lock and has just removed every backend's capture)."""
    fd, _ready = netfilter_marks()
    os.pwrite(fd, _MARK.pack(0), inode * _MARK.size)


def forget_thread_lock_fd() -> None:
    """Close this thread's fd of the lock file: the next lock opens (and checks) it again."""
    _tls.__dict__.pop("lock_file", None)


def _ofd_lock(fd: int, inode: int, lock: bool) -> None:
    """The netns lock of ``inode`` taken (``lock``) or given back on ``fd``, without waiting:
    ``rdr_netns_lock`` (native/pod_setup.c), the lock the eBPF fresh-pod call takes too."""
    from ..native import load

    rc = load().lib.rdr_netns_lock(fd, inode, int(lock))
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))


@contextlib.contextmanager
def netns_lock(inode: int, wait_s: float = LOCK_WAIT_S, name: str = "") -> Iterator[None]:
    """Hold the netns ``inode`` against other threads and processes that use this library.
    Waits at most ``wait_s`` for another holder, then raises ``SetupError`` naming the netns
    ``name`` (as the caller was given it) if given."""
    fd = thread_lock_fd()
    deadline = time.monotonic() + wait_s
    pause = 0.0005
    while True:
        try:
            _ofd_lock(fd, inode, True)
            break
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):  # held by another thread or process
                raise
        if time.monotonic() >= deadline:
            which = f"netns={name!r} (inode {inode})" if name else f"netns inode {inode}"
            raise SetupError(f"{which}: another thread or process has been changing it for over"
                             f" {wait_s:.0f} s (lock {os.path.join(run_dir_path(), NETNS_LOCK)}, byte {inode})")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    try:
        yield
    finally:
        _ofd_lock(fd, inode, False)
