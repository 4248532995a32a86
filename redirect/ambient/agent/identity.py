"""A pod's identity, kept by the kernel inside the pod's own network namespace.

The agent holds no state of its own: what it needs to re-enrol a pod after a restart
(uid, name, namespace, the config its rules were made from, the backend, the node
that owns it) is written into the pod netns as an ipset nobody matches on:

``rdr-pod-identity`` (``bitmap:port range 0-63 comment``)
    entry ``i``'s comment is chunk ``i`` of the record: unpadded base64url of its
    compact JSON, at most 240 characters per chunk (ipset comments hold 255).

The set is per netns, dies with the netns, is read back with one ``ipset save`` and
never affects traffic. It is replaced as a whole (build a scratch set, ``swap``,
destroy the scratch), so a reader sees the old record or the new one. The agent
writes it twice per enrolment: an *intent* record (``"phase": "intent"``) before it
installs anything, and the *commit* record (``"phase": "enrolled"``) after everything
is in place (``redirect.ambient.agent.enroller.Enroller.add``). The agent finds pods by listing
namespaces (``/run/netns``, ``/proc/*/ns/net``) that the node's user namespace owns
and reading this set in each; namespaces without it are not ours. What it reads is
validated like an event (``redirect.ambient.agent.pods``): a record is data, never trusted.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from ...errors import SetupError
from ...kernel import netns as _netns
from ..ipset import run as _ipset

SET = "rdr-pod-identity"
_SCRATCH = "rdr-pod-identity-new"
_CHUNK = 240
_MAX_CHUNKS = 64
RECORD_VERSION = 1


def _chunks(record: dict[str, Any]) -> list[str]:
    raw = json.dumps({"rv": RECORD_VERSION, **record}, separators=(",", ":"), sort_keys=True).encode()
    text = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    parts = [text[i : i + _CHUNK] for i in range(0, len(text), _CHUNK)]
    if len(parts) > _MAX_CHUNKS:
        raise SetupError(f"pod identity record of {len(raw)} bytes does not fit in {SET} "
                         f"({_MAX_CHUNKS * _CHUNK * 3 // 4} bytes at most): too many annotations?")
    return parts


def write(netns: _netns.NetnsRef, record: dict[str, Any]) -> None:
    """Store ``record`` (JSON-able) in ``netns``, replacing any earlier one."""
    lines = [f"create {_SCRATCH} bitmap:port range 0-{_MAX_CHUNKS - 1} comment -exist", f"flush {_SCRATCH}"]
    lines += [f'add {_SCRATCH} {i} comment "{c}"' for i, c in enumerate(_chunks(record))]
    lines += [f"create {SET} bitmap:port range 0-{_MAX_CHUNKS - 1} comment -exist",
              f"swap {_SCRATCH} {SET}", f"destroy {_SCRATCH}"]
    with _netns.enter(netns):
        _ipset(["restore"], "\n".join(lines) + "\n")


def parse(save_text: str) -> dict[str, Any] | None:
    """The record in ``ipset save`` output of our set, or None if there is none (or it is damaged)."""
    chunks: dict[int, str] = {}
    for line in save_text.splitlines():
        parts = line.split(None, 4)
        if len(parts) == 5 and parts[0] == "add" and parts[1] == SET and parts[3] == "comment":
            try:
                chunks[int(parts[2])] = parts[4].strip().strip('"')
            except ValueError:
                return None
    if not chunks or sorted(chunks) != list(range(len(chunks))):
        return None
    text = "".join(chunks[i] for i in range(len(chunks)))
    try:
        rec = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("rv") != RECORD_VERSION:
        return None
    rec.pop("rv")
    return rec


def read(netns: _netns.NetnsRef) -> dict[str, Any] | None:
    """The record stored in ``netns``, or None."""
    with _netns.enter(netns):
        p = _ipset(["save", SET], ok=(0, 1))
    return parse(p.stdout) if p.returncode == 0 else None


def scan(netns: _netns.NetnsRef) -> dict[str, Any] | None:
    """Like ``read``, over ipset netlink in-process (no exec): for looking at every netns of a
    node at start. Falls back to ``read`` if the netlink answer is not what we expect."""
    from pyroute2.ipset import IPSet, NoSuchObject

    with _netns.enter(netns):
        sock = IPSet()  # a netlink socket stays in the netns it was made in
    try:
        chunks: dict[int, str] = {}
        for msg in sock.list(SET):
            adt = msg.get_attr("IPSET_ATTR_ADT")
            for e in adt.get_attrs("IPSET_ATTR_DATA") if adt is not None else ():
                idx, comment = e.get_attr("IPSET_ATTR_PORT"), e.get_attr("IPSET_ATTR_COMMENT")
                if idx is None or comment is None:
                    return read(netns)
                chunks[int(idx)] = str(comment)
    except NoSuchObject:
        return None
    except Exception:  # noqa: BLE001 - an unexpected netlink shape: ask ipset(8)
        return read(netns)
    finally:
        sock.close()
    return parse("\n".join(f'add {SET} {i} comment "{c}"' for i, c in sorted(chunks.items())))


def exists(netns: _netns.NetnsRef) -> bool:
    """Whether ``netns`` has a set of our name (its header only: nothing of its content is read)."""
    from pyroute2.ipset import IPSet, NoSuchObject

    with _netns.enter(netns):
        sock = IPSet()
    try:
        sock.headers(SET)
        return True
    except NoSuchObject:
        return False
    finally:
        sock.close()


def clear(netns: _netns.NetnsRef) -> bool:
    """Remove the record from ``netns``; True if there was one."""
    with _netns.enter(netns):
        removed = False
        for name in (_SCRATCH, SET):
            p = _ipset(["destroy", name], ok=(0, 1))
            removed = removed or (name == SET and p.returncode == 0)
    return removed


__all__ = ["SET", "write", "read", "scan", "parse", "exists", "clear"]
