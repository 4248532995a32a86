"""The bpf(2) calls the eBPF backend makes, through the native module (``redirect.native``): pins,
links, programs and maps by fd.

``Map`` reads and writes a pinned map with keys and values as bytes in the ``redirect/bpf/abi.h``
layout (``..abi``); the link helpers read what a pinned ``bpf_link`` is attached to and detach it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any

from ....native import load

#: ``redirect._native`` (the cffi module: ``.lib``, ``.ffi``); ``NotBuilt``, naming what to do, when
#: the package was not built.
NATIVE: Any = load()


def check(rc: int, what: str) -> int:
    """``rc`` (a native call's answer) when it is not an error, else ``OSError`` naming ``what``."""
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


def obj_get(path: str) -> int:
    return check(NATIVE.lib.rdr_bpf_obj_get(path.encode()), f"BPF_OBJ_GET {path}")


def obj_pin(fd: int, path: str) -> None:
    check(NATIVE.lib.rdr_bpf_obj_pin(fd, path.encode()), f"BPF_OBJ_PIN {path}")


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    return check(NATIVE.lib.rdr_bpf_link_create(prog_fd, target_fd, attach_type, 0), "BPF_LINK_CREATE")


def prog_id(fd: int) -> int:
    out = NATIVE.ffi.new("uint32_t *")
    check(NATIVE.lib.rdr_bpf_prog_id(fd, out), "BPF_OBJ_GET_INFO_BY_FD")
    return int(out[0])


def attached_progs(target_fd: int, attach_type: int) -> list[int]:
    """The ids of the programs attached to ``target_fd`` (a sockhash: its sk_msg program) for
    ``attach_type`` (BPF_PROG_QUERY)."""
    most = 8
    ids = NATIVE.ffi.new("uint32_t[]", most)
    n = NATIVE.ffi.new("uint32_t *", most)
    check(NATIVE.lib.rdr_bpf_prog_query(target_fd, attach_type, ids, n), "BPF_PROG_QUERY")
    return [int(ids[i]) for i in range(min(int(n[0]), most))]


def link_info(fd: int) -> dict[str, int]:
    lid, typ, pid, at = (NATIVE.ffi.new("uint32_t *") for _ in range(4))
    tgt = NATIVE.ffi.new("uint64_t *")
    check(NATIVE.lib.rdr_bpf_link_info(fd, lid, typ, pid, at, tgt), "BPF_OBJ_GET_INFO_BY_FD")
    return {"id": int(lid[0]), "type": int(typ[0]), "prog_id": int(pid[0]), "attach_type": int(at[0]),
            "target": int(tgt[0])}


def fd_by_id(kind: str, ident: int) -> int | None:
    """A new fd of the program (``kind`` "prog") or map with id ``ident``; None if there is none."""
    lib = NATIVE.lib
    fd = int(lib.rdr_bpf_prog_get_fd_by_id(ident) if kind == "prog" else lib.rdr_bpf_map_get_fd_by_id(ident))
    return fd if fd >= 0 else None


def pinned_link_info(path: str) -> dict[str, int] | None:
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


def link_prog_fd(path: str) -> int | None:
    """A new fd of the program of the link pinned at ``path``, None if there is none."""
    info = pinned_link_info(path)
    return None if info is None else fd_by_id("prog", info["prog_id"])


def link_target(path: str) -> int | None:
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


def detach_pinned(path: str) -> int | None:
    """Detach the link pinned at ``path`` and unpin it (something pinned there that can't be opened
    is unpinned all the same). Its program's id (None: none was there, or it could not be read)."""
    try:
        fd = obj_get(path)
    except FileNotFoundError:
        return None
    except OSError:
        fd = -1
    prog = None
    if fd >= 0:
        try:
            with contextlib.suppress(OSError):
                prog = link_info(fd)["prog_id"]
            NATIVE.lib.rdr_bpf_link_detach(fd)
        finally:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return prog


def tcp_diag_ok() -> bool:
    """Whether sock_diag answers for TCP here (listeners are then looked up that way instead of by
    a bind probe of the port): one netlink dump."""
    return bool(NATIVE.lib.rdr_tcp_diag_ok())


class Map:
    """A pinned map opened by fd; keys and values are bytes in the C layout."""

    def __init__(self, name: str, fd: int, key_size: int, value_size: int) -> None:
        self.name, self.fd, self.key_size, self.value_size = name, fd, key_size, value_size

    def update(self, key: bytes, value: bytes) -> None:
        check(NATIVE.lib.rdr_bpf_map_update(self.fd, key, value, 0), f"update {self.name}")

    def lookup(self, key: bytes) -> bytes | None:
        buf = NATIVE.ffi.new("char[]", self.value_size)
        rc = NATIVE.lib.rdr_bpf_map_lookup(self.fd, key, buf)
        if rc == -errno.ENOENT:
            return None
        check(rc, f"lookup {self.name}")
        return bytes(NATIVE.ffi.buffer(buf, self.value_size))

    def delete(self, key: bytes) -> bool:
        rc = NATIVE.lib.rdr_bpf_map_delete(self.fd, key)
        if rc == -errno.ENOENT:
            return False
        check(rc, f"delete {self.name}")
        return True

    def keys(self, limit: int = 1 << 20) -> Iterator[bytes]:
        cur = NATIVE.ffi.NULL
        nxt = NATIVE.ffi.new("char[]", self.key_size)
        for _ in range(limit):
            rc = NATIVE.lib.rdr_bpf_map_next_key(self.fd, cur, nxt)
            if rc == -errno.ENOENT:
                return
            check(rc, f"next key {self.name}")
            k = bytes(NATIVE.ffi.buffer(nxt, self.key_size))
            yield k
            cur = k


__all__ = ["NATIVE", "check", "obj_get", "obj_pin", "link_create", "prog_id", "attached_progs", "link_info", "fd_by_id",
           "pinned_link_info", "link_prog_fd", "link_target", "detach_pinned", "tcp_diag_ok", "Map"]
