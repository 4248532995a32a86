"""Entering network namespaces on the calling thread, and always coming back.

A namespace is named by:

- a ``str``: ``"pid:N"``, the namespace of process ``N``; a path (it contains a ``/``:
  ``"/proc/42/ns/net"``, ``"./ns"``); otherwise a name under ``/run/netns`` (``"pod1"``, and
  ``"1"`` too: a bare number is a name, never a pid);
- an ``os.PathLike``: a path;
- ``Pid(n)``: the namespace of process ``n``; ``Fd(n)``: an open namespace fd;
- a plain ``int``: an fd if it is an open network-namespace fd, otherwise a pid.

``setns(2)`` acts on one OS thread, so many threads may each work in their own
namespace at the same time; ``enter()`` restores the thread's namespace on the way
out, even when the body raises.

``host_netns_reason()`` tells whether the namespace a thread entered is the host's own
(the initial one, pid 1's, or the one the caller came from): ``redirect.setup`` refuses to
install capture there unless asked to.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Union

from ..errors import NetnsError

NETNS_RUN_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
PID_PREFIX = "pid:"
#: The inode of the kernel's initial network namespace where the kernel gives it a fixed one
#: (``PROC_NET_INIT_INO``; dynamically numbered namespaces start at 0xF0000000, so no other
#: namespace has it on older kernels).
INIT_NET_INO = 0xEFFFFFF9
#: The inode of the initial pid namespace (``PROC_PID_INIT_INO``): in it, pid 1 is the host's init.
INIT_PID_NS_INO = 0xEFFFFFFC


class Pid(int):
    """A process id whose network namespace is meant."""


class Fd(int):
    """An open file descriptor of a network namespace."""


NetnsRef = Union[str, "os.PathLike[str]", int]


NS_GET_NSTYPE = 0xB703  # ioctl on an nsfs fd: which kind of namespace it is


def _is_netns_fd(fd: int) -> bool:
    try:
        return fcntl.ioctl(fd, NS_GET_NSTYPE) == CLONE_NEWNET
    except OSError:
        return False


def _pid_path(ref: str) -> str:
    n = ref[len(PID_PREFIX):]
    if not (n.isascii() and n.isdigit() and 0 < len(n) <= 10 and int(n) > 0):
        raise NetnsError(f"netns={ref!r}: expected pid:<process id> (ASCII digits, > 0)")
    return f"/proc/{int(n)}/ns/net"


def path_of(ref: NetnsRef) -> str | None:
    """The filesystem path of a namespace reference, or None for an fd."""
    if type(ref) is str and ref and "/" not in ref:
        if ref.startswith(PID_PREFIX):
            return _pid_path(ref)
        return NETNS_RUN_DIR + "/" + ref  # a name under NETNS_RUN_DIR: the common case, first
    if isinstance(ref, Fd):
        return None
    if isinstance(ref, Pid):
        return f"/proc/{int(ref)}/ns/net"
    if isinstance(ref, int):
        return None if _is_netns_fd(ref) else f"/proc/{ref}/ns/net"
    path = os.fspath(ref)
    if not path:
        raise NetnsError("netns='': empty namespace name")
    if path.startswith(PID_PREFIX) and "/" not in path:
        return _pid_path(path)
    if "/" not in path:
        return os.path.join(NETNS_RUN_DIR, path)
    return path


def describe(ref: NetnsRef) -> str:
    """A short human name for logs and errors."""
    if type(ref) is str and ref and "/" not in ref and not ref.startswith(PID_PREFIX):
        return ref  # a name under NETNS_RUN_DIR (the common case, without a path join)
    path = path_of(ref)
    if path is None:
        return f"fd {int(ref)}"  # type: ignore[arg-type]
    if path.startswith(NETNS_RUN_DIR + "/"):
        return path[len(NETNS_RUN_DIR) + 1 :]
    return path


#: How a namespace file is opened once it is known to be one (through its ``O_PATH`` fd: the very
#: file looked at). ``O_NONBLOCK`` and ``O_NOCTTY`` all the same: that open never blocks nor takes
#: a terminal, whatever it were to meet.
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


@functools.lru_cache(maxsize=1)
def _nsfs_dev() -> int:
    """The device of the kernel's namespace filesystem (nsfs): every namespace file is on it."""
    return os.stat("/proc/thread-self/ns/net").st_dev


def _kind_of(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return what
    return "a regular file"


def open_netns(ref: NetnsRef) -> int:
    """Open a namespace reference; the caller owns (and closes) the returned fd.

    Nothing but a network namespace is ever opened: the path is first opened ``O_PATH`` (which
    opens no file: a FIFO, a device or a plain file is refused without being opened) and looked
    at (a namespace file is a regular file on nsfs); then that very file is opened through its
    ``O_PATH`` fd, so a path swapped in between changes nothing, and checked again (a network
    namespace). Every path to a netns goes through here (``enter``, the inode, the cookie, the
    fds handed to node proxies)."""
    path = path_of(ref)
    if path is None:
        fd = int(ref)  # type: ignore[arg-type]
        if not _is_netns_fd(fd):
            raise NetnsError(f"netns=fd {fd}: not an open network namespace fd")
        return os.dup(fd)
    try:
        where = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NetnsError(f"netns={describe(ref)!r}: no such namespace ({path} does not exist)") from None
    except OSError as e:
        raise NetnsError(f"netns={describe(ref)!r}: cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(where)
        if not stat.S_ISREG(st.st_mode) or st.st_dev != _nsfs_dev():
            raise NetnsError(f"netns={describe(ref)!r}: {path} is {_kind_of(st)}, not a network namespace")
        try:
            fd = os.open(f"/proc/self/fd/{where}", _OPEN_FLAGS)
        except OSError as e:
            raise NetnsError(f"netns={describe(ref)!r}: cannot open {path}: {e.strerror}") from None
    finally:
        os.close(where)
    if not _is_netns_fd(fd):
        os.close(fd)
        raise NetnsError(f"netns={describe(ref)!r}: {path} is not a network namespace")
    return fd


def _setns(fd: int) -> None:
    from ..native import load

    rc = load().lib.rdr_setns(fd, CLONE_NEWNET)
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))


def netns_inode(ref: NetnsRef) -> int:
    """The inode number that identifies a namespace (as in ``net:[INODE]``)."""
    fd = open_netns(ref)
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


_entered = threading.local()


def current_fd() -> int | None:
    """The fd of the namespace the innermost ``enter`` of this thread put it in (None outside one).

    Valid until that ``enter`` exits; saves opening ``/proc/thread-self/ns/net`` again."""
    stack: list[int] | None = getattr(_entered, "fds", None)
    return stack[-1] if stack else None


def current_name() -> str:
    """The calling thread's netns for messages: as the innermost ``enter`` of this thread was given
    it (``describe``), else by its inode."""
    refs: list[NetnsRef] | None = getattr(_entered, "refs", None)
    return describe(refs[-1]) if refs else f"inode {current_inode()}"


def current_inode() -> int:
    """The inode of the calling thread's netns (an fstat when inside ``enter``)."""
    fd = current_fd()
    return os.fstat(fd).st_ino if fd is not None else os.stat("/proc/thread-self/ns/net").st_ino


#: getsockopt(SOL_SOCKET, SO_NETNS_COOKIE): the cookie of the socket's netns (Linux 5.14+).
SO_NETNS_COOKIE = 71


def current_cookie() -> int:
    """The cookie of the calling thread's netns (of a socket made in it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), sys.byteorder)


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _setns_hint(e: OSError) -> str:
    """What to do about a failed setns, when it is for want of ``CAP_SYS_ADMIN``."""
    from .caps import has

    if e.errno != errno.EPERM or has("SYS_ADMIN"):
        return ""
    return " (entering another network namespace needs CAP_SYS_ADMIN, which this process lacks; run inside it)"


@contextlib.contextmanager
def enter(ref: NetnsRef) -> Iterator[int]:
    """Run the body with the calling thread in namespace ``ref``; yields its fd.

    The thread's own namespace is restored on exit. If restoring fails the thread
    is unusable and the error is raised as ``SystemError`` rather than carrying on
    in the wrong namespace. A thread already in ``ref`` stays where it is: no ``setns``,
    which needs ``CAP_SYS_ADMIN`` even into the thread's own namespace (``redirect init``
    in an init container has ``NET_ADMIN`` and ``NET_RAW`` only). ``host_netns_reason``
    judges the namespace all the same.
    """
    target = open_netns(ref)
    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(target)
        raise
    try:
        moves = not _same_file(target, home)
        if moves:
            try:
                _setns(target)
            except OSError as e:
                raise NetnsError(f"netns={describe(ref)!r}: setns failed: {e.strerror}"
                                 f"{_setns_hint(e)}") from None
        stack = _entered.__dict__.setdefault("fds", [])
        homes = _entered.__dict__.setdefault("homes", [])
        refs = _entered.__dict__.setdefault("refs", [])  # (named only if a message needs it)
        stack.append(target)
        homes.append(home)
        refs.append(ref)
        try:
            yield target
        finally:
            stack.pop()
            homes.pop()
            refs.pop()
            if moves:
                try:
                    _setns(home)
                except OSError as e:  # pragma: no cover - kernel out of memory
                    raise SystemError(f"could not return to the thread's own netns: {e}") from e
    finally:
        os.close(home)
        os.close(target)


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread that runs ``target`` in the calling thread's own network namespace:
    the one it was in before its outermost ``enter``, never one it entered.

    A new thread starts in its creator's namespace, and a thread holds its namespace alive: a
    long-lived thread started inside ``enter(pod)`` would keep that pod's netns (its interfaces,
    its addresses) alive after the pod is gone. Every thread the library starts lazily, whoever
    happens to be the first caller, starts here. (Outside any ``enter`` it is a plain thread; one
    started inside an ``enter`` of the caller's own namespace makes no setns, which needs
    ``CAP_SYS_ADMIN`` even there.)"""
    homes: list[int] | None = getattr(_entered, "homes", None)
    home = os.dup(homes[0]) if homes else None

    def run() -> None:
        if home is not None:
            try:
                here = os.stat("/proc/thread-self/ns/net")
                st = os.fstat(home)
                if (st.st_dev, st.st_ino) != (here.st_dev, here.st_ino):  # (as enter: no setns into its own)
                    _setns(home)
            except OSError as e:  # pragma: no cover - kernel out of memory
                raise SystemError(f"thread {name}: could not leave the creator's netns: {e}") from e
            finally:
                os.close(home)
        target()

    t = threading.Thread(target=run, name=name, daemon=True)
    try:
        t.start()
    except BaseException:
        if home is not None:
            os.close(home)
        raise
    return t


@functools.lru_cache(maxsize=1)
def _pid1_netns() -> tuple[int, int] | None:
    """(dev, inode) of pid 1's netns when this process is in the initial pid namespace (there pid
    1 is the host's init); None elsewhere (a container's pid 1 is its own) or if unreadable."""
    try:
        if os.stat("/proc/self/ns/pid").st_ino != INIT_PID_NS_INO:
            return None
        st = os.stat("/proc/1/ns/net")
    except OSError:
        return None  # (some sandboxes hide pid 1's namespaces even from root)
    return st.st_dev, st.st_ino


def host_netns_inodes() -> tuple[int, int]:
    """The inodes of the host's network namespace as far as they are known without entering
    anything: the kernel's fixed one of the initial netns, and pid 1's (0 when not known)."""
    pid1 = _pid1_netns()
    return INIT_NET_INO, (pid1[1] if pid1 is not None else 0)


def host_netns_reason(own_ok: bool = False) -> str | None:
    """Why the netns the calling thread entered (innermost ``enter``) is the host's, or None.

    The host's is the kernel's initial network namespace, pid 1's (seen from the initial pid
    namespace), or, unless ``own_ok``, the caller's own: the one the thread was in before its
    outermost ``enter`` (for a node agent or a CNI plugin, the node's). Two ``fstat`` calls on
    fds ``enter`` holds anyway."""
    stack: list[int] | None = getattr(_entered, "fds", None)
    if not stack:
        raise RuntimeError("host_netns_reason() outside netns.enter()")
    return _host_reason(os.fstat(stack[-1]), None if own_ok else os.fstat(_entered.homes[0]))


def host_netns_reason_of(ref: NetnsRef) -> str | None:
    """``host_netns_reason`` of the namespace ``ref`` names, without entering it (the caller's
    own being the one its thread is in, or was in before its outermost ``enter``)."""
    fd = open_netns(ref)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    homes: list[int] | None = getattr(_entered, "homes", None)
    home = os.fstat(homes[0]) if homes else os.stat("/proc/thread-self/ns/net")
    return _host_reason(st, home)


def _host_reason(st: os.stat_result, home: os.stat_result | None) -> str | None:
    if home is not None and (st.st_dev, st.st_ino) == (home.st_dev, home.st_ino):
        return "it is the caller's own network namespace (the host's, when run on a node)"
    if st.st_ino == INIT_NET_INO:
        return "it is the host's initial network namespace"
    if (st.st_dev, st.st_ino) == _pid1_netns():
        return "it is the network namespace of pid 1 (the host's)"
    return None


def _cookie_of(fd: int, ref: NetnsRef) -> int:
    from ..native import load

    native = load()
    ffi, lib = native.ffi, native.lib

    out = ffi.new("uint64_t *")
    rc = lib.rdr_netns_cookie(fd, out)
    if rc < 0:
        raise NetnsError(f"netns={describe(ref)!r}: reading the cookie failed: {os.strerror(-rc)}")
    return int(out[0])


def netns_cookie(ref: NetnsRef) -> int:
    """The kernel's 64-bit cookie for a namespace (what BPF programs see)."""
    fd = open_netns(ref)
    try:
        return _cookie_of(fd, ref)
    finally:
        os.close(fd)


def netns_key(ref: NetnsRef) -> tuple[int, int]:
    """(inode, cookie) of a namespace, from one open: what the kernel says it is. An inode is
    reused once its namespace is gone; a cookie never is while the host is up, so the two name
    one namespace for good (the node agent keys its records by them)."""
    fd = open_netns(ref)
    try:
        return os.fstat(fd).st_ino, _cookie_of(fd, ref)
    finally:
        os.close(fd)
