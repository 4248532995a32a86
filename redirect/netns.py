"""Entering network namespaces on the calling thread, and always coming back.

A namespace is named by:

- a ``str``: a name under ``/run/netns`` (``"pod1"``) or a path (``"/proc/42/ns/net"``);
- an ``os.PathLike``: a path;
- ``Pid(n)``: the namespace of process ``n``; ``Fd(n)``: an open namespace fd;
- a plain ``int``: an fd if it is an open network-namespace fd, otherwise a pid.

``setns(2)`` acts on one OS thread, so many threads may each work in their own
namespace at the same time; ``enter()`` restores the thread's namespace on the way
out, even when the body raises.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from typing import Union

from .errors import NetnsError

NETNS_RUN_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000


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


def path_of(ref: NetnsRef) -> str | None:
    """The filesystem path of a namespace reference, or None for an fd."""
    if type(ref) is str and ref and "/" not in ref:
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
    if "/" not in path:
        return os.path.join(NETNS_RUN_DIR, path)
    return path


def describe(ref: NetnsRef) -> str:
    """A short human name for logs and errors."""
    if type(ref) is str and ref and "/" not in ref:
        return ref  # a name under NETNS_RUN_DIR (the common case, without a path join)
    path = path_of(ref)
    if path is None:
        return f"fd {int(ref)}"  # type: ignore[arg-type]
    if path.startswith(NETNS_RUN_DIR + "/"):
        return path[len(NETNS_RUN_DIR) + 1 :]
    return path


def open_netns(ref: NetnsRef) -> int:
    """Open a namespace reference; the caller owns (and closes) the returned fd."""
    path = path_of(ref)
    if path is None:
        fd = int(ref)  # type: ignore[arg-type]
        if not _is_netns_fd(fd):
            raise NetnsError(f"netns=fd {fd}: not an open network namespace fd")
        return os.dup(fd)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NetnsError(f"netns={describe(ref)!r}: no such namespace ({path} does not exist)") from None
    except OSError as e:
        raise NetnsError(f"netns={describe(ref)!r}: cannot open {path}: {e.strerror}") from None
    if not _is_netns_fd(fd):
        os.close(fd)
        raise NetnsError(f"netns={describe(ref)!r}: {path} is not a network namespace")
    return fd


def _setns(fd: int) -> None:
    from ._native import lib

    rc = lib.rdr_setns(fd, CLONE_NEWNET)
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


def current_inode() -> int:
    """The inode of the calling thread's netns (an fstat when inside ``enter``)."""
    fd = current_fd()
    return os.fstat(fd).st_ino if fd is not None else os.stat("/proc/thread-self/ns/net").st_ino


@contextlib.contextmanager
def enter(ref: NetnsRef) -> Iterator[int]:
    """Run the body with the calling thread in namespace ``ref``; yields its fd.

    The thread's own namespace is restored on exit. If restoring fails the thread
    is unusable and the error is raised as ``SystemError`` rather than carrying on
    in the wrong namespace.
    """
    target = open_netns(ref)
    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(target)
        raise
    try:
        try:
            _setns(target)
        except OSError as e:
            raise NetnsError(f"netns={describe(ref)!r}: setns failed: {e.strerror}") from None
        stack = _entered.__dict__.setdefault("fds", [])
        stack.append(target)
        try:
            yield target
        finally:
            stack.pop()
            try:
                _setns(home)
            except OSError as e:  # pragma: no cover - kernel out of memory
                raise SystemError(f"could not return to the thread's own netns: {e}") from e
    finally:
        os.close(home)
        os.close(target)


def netns_cookie(ref: NetnsRef) -> int:
    """The kernel's 64-bit cookie for a namespace (what BPF programs see)."""
    from ._native import ffi, lib

    fd = open_netns(ref)
    try:
        out = ffi.new("uint64_t *")
        rc = lib.rdr_netns_cookie(fd, out)
        if rc < 0:
            raise NetnsError(f"netns={describe(ref)!r}: reading the cookie failed: {os.strerror(-rc)}")
        return int(out[0])
    finally:
        os.close(fd)
