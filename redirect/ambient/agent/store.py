"""The agent's record of its pods: on the node, in a directory only root may write.

A pod's netns is the pod's: with a user namespace of its own its root can write anything there,
so nothing the agent must believe after a restart is kept in it. The record of each pod lives in
``<run dir>/agent-pods/`` (``/run/redirect/agent-pods``; ``REDIRECT_RUN_DIR`` names another run
dir), checked as the lock directory is (``redirect.kernel.locks``): a real directory of root's,
mode ``0700``; each record a regular file of root's, mode ``0600``, opened with ``O_NOFOLLOW``
relative to the checked directory. One file per pod netns, named by what the kernel says of that
netns, never by anything a pod can write::

    net-<inode>-<cookie>.json

(an inode is reused once its netns is gone, a cookie never while the node is up; the record
also names the boot it was written in, so a record that outlived a reboot is known for stale).
A record is written whole: a scratch file (``O_CREAT|O_EXCL|O_NOFOLLOW``), ``fsync``, ``rename``
over the old one, ``fsync`` of the directory; a reader sees the old record or the new one. Its
content is the pod as ``pods.PodRecord.record`` gives it; what is read back is validated like an
event all the same (``pods.from_record``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from ...errors import SetupError
from ...kernel import locks

#: The records' directory, in the run directory.
DIR = "agent-pods"
#: What a record may weigh (a pod's config and a few names: a few KB).
MAX_RECORD = 256 * 1024
RECORD_VERSION = 2
NAME_RE = re.compile(r"^net-([0-9]{1,20})-([0-9]{1,20})\.json$")
_SCRATCH_RE = re.compile(r"^\.net-[0-9]+-[0-9]+\.json\.([0-9]+)\.[0-9]+\.tmp$")

#: (inode, cookie) of a netns.
Key = tuple[int, int]


class BadRecord(ValueError):
    """A file in the store that is not a record the agent writes (the message says why)."""


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This boot of the node (``/proc/sys/kernel/random/boot_id``)."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        return f.read().strip()


def name_of(key: Key) -> str:
    return f"net-{key[0]}-{key[1]}.json"


def path_of(key: Key) -> str:
    """The record's path (for messages: files are opened relative to the checked directory)."""
    return os.path.join(locks.run_dir_path(), DIR, name_of(key))


@contextlib.contextmanager
def _dir() -> Iterator[int]:
    fd = locks.open_private_dir(DIR)
    try:
        yield fd
    finally:
        os.close(fd)


def write(key: Key, record: dict[str, Any]) -> None:
    """Store ``record`` (JSON-able) as the record of the netns ``key``, replacing any earlier one."""
    data = json.dumps({"rv": RECORD_VERSION, "boot": boot_id(), **record}, separators=(",", ":"),
                      sort_keys=True).encode()
    if len(data) > MAX_RECORD:
        raise SetupError(f"pod record of {len(data)} bytes is larger than {MAX_RECORD}: too many annotations?")
    name = name_of(key)
    scratch = f".{name}.{os.getpid()}.{threading.get_native_id()}.tmp"
    with _dir() as dfd:
        try:
            fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
        except FileExistsError:  # left by a thread of a process that had our pid: not ours to keep
            os.unlink(scratch, dir_fd=dfd)
            fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(scratch, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(scratch, dir_fd=dfd)
            raise
        os.fsync(dfd)


def _read_at(dfd: int, name: str) -> dict[str, Any]:
    """The record in ``name``; ``BadRecord`` if it is not one the agent writes (``FileNotFoundError``
    if there is none)."""
    path = os.path.join(locks.run_dir_path(), DIR, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise
        raise BadRecord(f"{path}: {'is a symlink' if e.errno == errno.ELOOP else e.strerror}") from None
    try:
        fd = locks.check_private_file(fd, path)  # (closed if it is not as it must be)
    except SetupError as e:
        raise BadRecord(str(e).split(";", 1)[0]) from None
    try:
        raw = b""
        while len(raw) <= MAX_RECORD:
            chunk = os.read(fd, MAX_RECORD + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    finally:
        os.close(fd)
    if len(raw) > MAX_RECORD:
        raise BadRecord(f"{path}: larger than {MAX_RECORD} bytes")
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRecord(f"{path}: not a JSON record") from None
    if not isinstance(rec, dict) or rec.get("rv") != RECORD_VERSION:
        raise BadRecord(f"{path}: not a record of version {RECORD_VERSION}")
    m = NAME_RE.match(name)
    assert m is not None
    if (rec.get("netns_inode"), rec.get("netns_cookie")) != (int(m.group(1)), int(m.group(2))):
        raise BadRecord(f"{path}: names another netns than its file name")
    return rec


def read(key: Key) -> dict[str, Any] | None:
    """The record of the netns ``key`` (None if there is none); ``BadRecord`` if it is not one."""
    with _dir() as dfd:
        try:
            return _read_at(dfd, name_of(key))
        except FileNotFoundError:
            return None


def remove(key: Key) -> bool:
    """Remove the record of the netns ``key``; True if there was one."""
    with _dir() as dfd:
        try:
            os.unlink(name_of(key), dir_fd=dfd)
        except FileNotFoundError:
            return False
        os.fsync(dfd)
        return True


def records() -> Iterator[tuple[Key, dict[str, Any] | BadRecord]]:
    """Every record in the store: (its netns, the record or why it is not one). Scratch files of
    writers that are gone are removed on the way."""
    with _dir() as dfd:
        for name in sorted(os.listdir(dfd)):
            m = NAME_RE.match(name)
            if m is None:
                s = _SCRATCH_RE.match(name)
                if s is not None and not os.path.exists(f"/proc/{s.group(1)}"):
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=dfd)
                continue
            key = (int(m.group(1)), int(m.group(2)))
            try:
                yield key, _read_at(dfd, name)
            except FileNotFoundError:
                continue  # removed meanwhile
            except BadRecord as e:
                yield key, e


__all__ = ["DIR", "Key", "BadRecord", "RECORD_VERSION", "boot_id", "name_of", "path_of", "write", "read", "remove",
           "records"]
