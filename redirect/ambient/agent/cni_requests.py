"""The agent's side of the thin CNI plugin: serve a raw CNI request in the agent's process.

The thin plugin (``native/cni_thin.c``, installed as ``redirect-cni``) parses nothing of the
network config beyond the few top-level keys it needs to reach the agent: it sends the
request as it got it (the ``CNI_*`` environment in the message, stdin as a sealed memfd) in
a ``cni`` message on the events socket (docs/agent-protocol.md). Here the request goes
through ``redirect.cni.plugin.run``, the very code the Python plugin runs, so the config
merge, the annotations, the error codes and the netns lock are the same; ambient pods are
enrolled by this agent directly (``Agent.handle``), sidecar pods are set up with the
configured backend in-process. The reply carries the plugin's exit code, and its stdout as
a memfd the thin plugin copies to its own stdout.

Each request runs on one of the agent's event workers (``--workers``), so many ADDs are
served at once and a slow pod holds only its own worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Any

from ...cni import netconf, plugin
from ...errors import RedirectError
from ...kernel import netns as _netns
from .metrics import Metrics

#: The agent's own handler of an ambient pod's request (``Agent.handle``), which the plugin's code
#: calls in place of the agent's socket.
NodeAgent = Callable[[dict[str, Any]], dict[str, Any]]
#: The uid of the ambient pod the agent has (enrolled, being enrolled, or recorded in its store)
#: in the netns of this key (inode, cookie), or None.
AmbientOwner = Callable[[tuple[int, int]], "str | None"]

log = logging.getLogger("redirect.agent")

#: the environment the thin plugin forwards (CNI spec 1.1 "Parameters"); nothing else is read
CNI_ENV = netconf.CNI_ENV
MAX_ENV_VALUE = netconf.MAX_ENV_VALUE


class BadRequest(Exception):
    """The ``cni`` message itself is malformed (not the CNI request it carries)."""


def _stdin(fds: list[int], length: object) -> bytes:
    if len(fds) != 1:
        raise BadRequest(f"a cni message carries exactly one fd (stdin), got {len(fds)}")
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= netconf.MAX_STDIN:
        raise BadRequest(f"cni.stdin_len={length!r}: expected 0..{netconf.MAX_STDIN}")
    st = os.fstat(fds[0])
    if not stat.S_ISREG(st.st_mode):
        raise BadRequest("cni: the stdin fd is not a regular file (memfd)")
    if st.st_size != length:
        raise BadRequest(f"cni: the stdin fd holds {st.st_size} bytes, stdin_len says {length}")
    data = b""
    while len(data) < length:
        chunk = os.pread(fds[0], length - len(data), len(data))
        if not chunk:
            raise BadRequest("cni: the stdin fd ended early")
        data += chunk
    return data


def _env(raw: object) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise BadRequest("cni.env: expected an object of strings")
    env: dict[str, str] = {}
    for k, v in raw.items():
        if k not in CNI_ENV:
            raise BadRequest(f"cni.env: {k!r} is not a CNI variable ({', '.join(CNI_ENV)})")
        if not isinstance(v, str) or len(v) > MAX_ENV_VALUE:
            raise BadRequest(f"cni.env.{k}: expected a string of at most {MAX_ENV_VALUE} chars")
        env[k] = v
    return env


def _ambient_netns(env: dict[str, str], stdin: bytes, owner: AmbientOwner) -> tuple[int, dict[str, Any]] | None:
    """A sidecar ADD, DEL or CHECK whose ``CNI_NETNS`` is an ambient pod's netns this agent has
    (compared by inode and cookie, not by path) is refused with code 7 naming ``CNI_NETNS``: it
    would replace, tear down or judge that pod's capture. None: not such a request (a config the
    plugin refuses anyway, a netns that is gone, an ambient request: the plugin's own answer)."""
    if env.get("CNI_COMMAND") not in ("ADD", "DEL", "CHECK") or not env.get("CNI_NETNS"):
        return None
    try:
        conf = netconf.parse_netconf(stdin)
    except netconf.CniError:
        return None
    if conf.get("mode", netconf.DEFAULTS["mode"]) == "ambient":
        return None
    try:
        fd = _netns.open_netns(env["CNI_NETNS"])
    except (RedirectError, OSError):
        return None  # gone, or not a netns: the plugin says so (a DEL succeeds)
    try:
        key = os.fstat(fd).st_ino, _netns.netns_cookie(_netns.Fd(fd))
    except (RedirectError, OSError):
        return None
    finally:
        os.close(fd)
    uid = owner(key)
    if uid is None:
        return None
    msg = (f"CNI_NETNS={env['CNI_NETNS'][:256]!r}: that netns is ambient pod {uid}'s (enrolled by this node's "
           f"agent); a sidecar {env['CNI_COMMAND']} there is refused and nothing was changed")
    log.error("cni %s refused: %s", env["CNI_COMMAND"], msg, extra={"fields": {"reason": "netns"}})
    version = conf.get("cniVersion")
    return 1, {"cniVersion": version if isinstance(version, str) else netconf.LATEST, "code": netconf.E_ENV,
               "msg": msg, "details": ""}


def handle(metrics: Metrics, node_agent: NodeAgent, msg: dict[str, Any],
           fds: list[int], owner: AmbientOwner | None = None) -> tuple[dict[str, Any], bytes]:
    """One ``cni`` message, counted in ``metrics``, its ambient pods enrolled by ``node_agent``:
    (the ``result`` message, the plugin's stdout); ``owner``: whose ambient netns a key is (a
    sidecar request there is refused). Never raises."""
    t0 = time.perf_counter()
    command = ""
    try:
        req = msg.get("cni")
        if not isinstance(req, dict):
            raise BadRequest("cni: expected an object with env and stdin_len")
        env = _env(req.get("env"))
        command = env.get("CNI_COMMAND", "")
        stdin = _stdin(fds, req.get("stdin_len"))
    except (BadRequest, OSError) as e:
        metrics.inc("failures", "bad_request")
        log.error("cni request refused: %s", e, extra={"fields": {"reason": "bad_request"}})
        return {"type": "result", "ok": False, "reason": "bad_request", "error": str(e)}, b""
    refused = _ambient_netns(env, stdin, owner) if owner is not None else None
    rc, out = refused if refused is not None else plugin.run(env, stdin, node_agent=node_agent)
    metrics.inc("events", f"cni_{command.lower()}" if command in netconf.COMMANDS else "cni")
    if rc != 0:
        metrics.inc("failures", "cni")
    ms = round((time.perf_counter() - t0) * 1e3, 2)
    log.debug("cni %s", command, extra={"fields": {"rc": rc, "ms": ms, "container": env.get("CNI_CONTAINERID", "")}})
    return {"type": "result", "ok": True, "rc": rc, "ms": ms}, netconf.encode_output(out) if out else b""


def serve(metrics: Metrics, node_agent: NodeAgent, msg: dict[str, Any],
          fds: list[int], owner: AmbientOwner | None = None) -> tuple[dict[str, Any], list[int]]:
    """One ``cni`` message (the events server's handler for it): the reply, and a memfd with the
    plugin's stdout to send with it (the caller closes it once sent). Closes ``fds``."""
    try:
        reply, out = handle(metrics, node_agent, msg, fds, owner)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    memfd = os.memfd_create("redirect-cni-out", os.MFD_CLOEXEC)
    try:
        _write_all(memfd, out)
    except BaseException:
        os.close(memfd)
        raise
    return reply, [memfd]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


__all__ = ["CNI_ENV", "NodeAgent", "BadRequest", "handle", "serve"]
