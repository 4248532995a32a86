"""What the CNI plugin calls: send a pod event to the agent and wait for its answer."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

from . import protocol

#: Where an event goes: the agent's events socket (a path), or, inside the agent, the function
#: that handles an event (``Agent.handle``: message in, ``result`` message out).
AgentTarget = Union[str, Callable[[dict[str, Any]], dict[str, Any]]]


#: ``AgentError`` reasons of an event the agent gave no answer to: none listens at the socket
#: (``unreachable``), it closed the connection without answering (``gone``: killed or restarting
#: mid-request), or it did not answer in time (``timeout``). Any other reason is the agent's own.
NO_ANSWER = ("unreachable", "gone", "timeout")


class AgentError(Exception):
    """The agent refused the event, or could not be reached in time. ``reason`` is its reason."""

    def __init__(self, reason: str, msg: str) -> None:
        super().__init__(msg)
        self.reason = reason


def _call(socket_path: AgentTarget, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
    if callable(socket_path):  # in the agent's own process: no socket, no timeout to wait out
        return _result(socket_path({"v": protocol.VERSION, **msg}))
    try:
        out = protocol.request(socket_path, msg, timeout)
    except TimeoutError:
        raise AgentError("timeout", f"the node agent at {socket_path} did not answer within {timeout} s") from None
    except FileNotFoundError:
        raise AgentError("unreachable", f"no node agent at {socket_path} (socket does not exist)") from None
    except (ConnectionResetError, BrokenPipeError) as e:  # (connected: it went away before it answered)
        raise AgentError("gone", f"the node agent at {socket_path} went away without answering (restarting?)"
                         + (f": {e.strerror}" if e.strerror else "")) from None
    except OSError as e:
        raise AgentError("unreachable", f"node agent at {socket_path}: {e.strerror or e}") from None
    except protocol.ProtocolError as e:
        raise AgentError("protocol", f"node agent at {socket_path}: {e}") from None
    return _result(out)


def _result(out: dict[str, Any]) -> dict[str, Any]:
    if out.get("type") != "result" or not out.get("ok"):
        raise AgentError(str(out.get("reason", "refused")), str(out.get("error", out)))
    return out


def add_pod(socket_path: AgentTarget, *, uid: str, netns: str, name: str = "", namespace: str = "",
            ips: Iterable[str] = (), annotations: Mapping[str, str] | None = None, container_id: str = "",
            config: Mapping[str, Any] | None = None, backend: str | None = None,
            timeout: float = 10.0) -> dict[str, Any]:
    """Enrol a pod; returns the agent's result once the node proxy has it. Raises ``AgentError``."""
    pod: dict[str, Any] = {"uid": uid, "netns": netns, "name": name, "namespace": namespace, "ips": list(ips),
                           "annotations": dict(annotations or {}), "container_id": container_id}
    if config is not None:
        pod["config"] = dict(config)
    if backend is not None:
        pod["backend"] = backend
    msg = {"type": "add", "pod": pod}
    if config is not None and len(protocol.encode(msg, check=False)) > protocol.MAX_MESSAGE:
        pod["annotations"] = {}  # informative only when the config is given: keep the event under the limit
    return _call(socket_path, msg, timeout)


def del_pod(socket_path: AgentTarget, *, uid: str = "", netns: str = "", container_id: str = "",
            timeout: float = 10.0) -> dict[str, Any]:
    """Remove a pod (idempotent). Raises ``AgentError``."""
    return _call(socket_path, {"type": "del", "pod": {"uid": uid, "netns": netns, "container_id": container_id}},
                 timeout)


def check_pod(socket_path: AgentTarget, *, uid: str, netns: str = "", timeout: float = 10.0) -> dict[str, Any]:
    """Whether the agent has the pod, with intact rules and a proxy. Raises ``AgentError`` (reason ``check``)."""
    return _call(socket_path, {"type": "check", "pod": {"uid": uid, "netns": netns}}, timeout)


def list_pods(socket_path: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The pods the agent has enrolled (page by page: ``after`` the last one's uid, while ``next`` says
    more follow; bounded by ``timeout`` for the whole list)."""
    deadline = time.monotonic() + timeout
    out: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        msg: dict[str, Any] = {"type": "list"} if after is None else {"type": "list", "after": after}
        got = _call(socket_path, msg, max(deadline - time.monotonic(), 0.001))
        pods = got.get("pods", [])
        out += pods if isinstance(pods, list) else []
        nxt = got.get("next")
        if not isinstance(nxt, str) or (after is not None and nxt <= after):
            return out
        after = nxt


__all__ = ["AgentTarget", "AgentError", "NO_ANSWER", "add_pod", "del_pod", "check_pod", "list_pods"]
