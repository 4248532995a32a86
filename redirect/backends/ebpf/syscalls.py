"""The bpf(2) calls the eBPF backend makes (through ``redirect._native``): pins, links, maps by fd.

``Map`` reads and writes a pinned map with keys and values as bytes in the ``redirect/bpf/abi.h`` layout
(``.abi``); the link helpers read what a pinned ``bpf_link`` is attached to and detach it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Iterator
from typing import Any

from ...kernel import netns as _netns
from ...native import load

_native_module = load()  # NotBuilt, naming what to do, when the package was not built


def _native() -> Any:
    """``redirect._native`` (the cffi module: ``.lib``, ``.ffi``)."""
    return _native_module


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


def obj_get(path: str) -> int:
    return _check(_native().lib.rdr_bpf_obj_get(path.encode()), f"BPF_OBJ_GET {path}")


def obj_pin(fd: int, path: str) -> None:
    _check(_native().lib.rdr_bpf_obj_pin(fd, path.encode()), f"BPF_OBJ_PIN {path}")


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    return _check(_native().lib.rdr_bpf_link_create(prog_fd, target_fd, attach_type, 0), "BPF_LINK_CREATE")


def prog_id(fd: int) -> int:
    n = _native()
    out = n.ffi.new("uint32_t *")
    _check(n.lib.rdr_bpf_prog_id(fd, out), "BPF_OBJ_GET_INFO_BY_FD")
    return int(out[0])


def link_info(fd: int) -> dict[str, int]:
    n = _native()
    lid, typ, pid, at = (n.ffi.new("uint32_t *") for _ in range(4))
    tgt = n.ffi.new("uint64_t *")
    _check(n.lib.rdr_bpf_link_info(fd, lid, typ, pid, at, tgt), "BPF_OBJ_GET_INFO_BY_FD")
    return {"id": int(lid[0]), "type": int(typ[0]), "prog_id": int(pid[0]), "attach_type": int(at[0]),
            "target": int(tgt[0])}


def _fd_by_id(kind: str, ident: int) -> int | None:
    lib = _native().lib
    fd = int(lib.rdr_bpf_prog_get_fd_by_id(ident) if kind == "prog" else lib.rdr_bpf_map_get_fd_by_id(ident))
    return fd if fd >= 0 else None


def _pinned_link_info(path: str) -> dict[str, int] | None:
    """``link_info`` of the link pinned at ``path``; None if there is none (or it can't be read)."""
    try:
        fd = obj_get(path)
    except OSError:
        return None
    try:
        return link_info(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _link_prog_fd(path: str) -> int | None:
    """A new fd of the program of the link pinned at ``path``, None if there is none."""
    info = _pinned_link_info(path)
    return None if info is None else _fd_by_id("prog", info["prog_id"])


def _link_target(path: str) -> int | None:
    """The netns inode a pinned netns link is attached to (0: detached, its netns is gone);
    None: no pin; -1: something is pinned there that can't be read as a netns link."""
    try:
        fd = obj_get(path)
    except FileNotFoundError:
        return None
    except OSError:
        return -1
    try:
        return int(link_info(fd)["target"])
    except OSError:
        return -1
    finally:
        os.close(fd)


def _detach_pinned(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = obj_get(path)
        try:
            _native().lib.rdr_bpf_link_detach(fd)
        finally:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
def current_netns_cookie() -> int:
    """The cookie of the calling thread's netns (``redirect.kernel.netns.current_cookie``)."""
    return _netns.current_cookie()


class Map:
    """A pinned map opened by fd; keys and values are bytes in the C layout."""

    def __init__(self, name: str, fd: int, key_size: int, value_size: int) -> None:
        self.name, self.fd, self.key_size, self.value_size = name, fd, key_size, value_size

    def update(self, key: bytes, value: bytes) -> None:
        _check(_native().lib.rdr_bpf_map_update(self.fd, key, value, 0), f"update {self.name}")

    def lookup(self, key: bytes) -> bytes | None:
        n = _native()
        buf = n.ffi.new("char[]", self.value_size)
        rc = n.lib.rdr_bpf_map_lookup(self.fd, key, buf)
        if rc == -errno.ENOENT:
            return None
        _check(rc, f"lookup {self.name}")
        return bytes(n.ffi.buffer(buf, self.value_size))

    def delete(self, key: bytes) -> bool:
        rc = _native().lib.rdr_bpf_map_delete(self.fd, key)
        if rc == -errno.ENOENT:
            return False
        _check(rc, f"delete {self.name}")
        return True

    def keys(self, limit: int = 1 << 20) -> Iterator[bytes]:
        n = _native()
        cur = n.ffi.NULL
        nxt = n.ffi.new("char[]", self.key_size)
        for _ in range(limit):
            rc = n.lib.rdr_bpf_map_next_key(self.fd, cur, nxt)
            if rc == -errno.ENOENT:
                return
            _check(rc, f"next key {self.name}")
            k = bytes(n.ffi.buffer(nxt, self.key_size))
            yield k
            cur = k


@functools.lru_cache(maxsize=1)
def _tcp_diag_ok() -> bool:
    """Whether sock_diag answers for TCP here (the fresh-pod call then looks the proxy's listener
    up that way instead of probing the port with a bind)."""
    return bool(_native().lib.rdr_tcp_diag_ok())
