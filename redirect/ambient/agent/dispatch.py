"""What answers a message on the events socket: ``add``, ``del``, ``check``, ``list``, ``status``.

``Dispatcher.handle`` is the events server's handler (``events.EventServer``): it never raises,
every failure is a ``result`` with ``ok: false``, a ``reason`` (also the failure metric's label)
and an ``error`` that names the field and the value. Wire format: docs/agent-protocol.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from .enroller import Enroller, EventError
from .logs import jlog, log
from .metrics import Metrics
from .pods import BadPod

#: Bytes of pods in one ``list`` page at most (the message limit is 64 KiB; one pod, whose recorded
#: netns path may be 4 KiB, always fits).
LIST_PAGE_BYTES = 48 * 1024


class Dispatcher:
    def __init__(self, enroller: Enroller, metrics: Metrics,
                 readiness: Callable[[], tuple[bool, dict[str, Any]]]) -> None:
        self.enroller = enroller
        self.metrics = metrics
        self.readiness = readiness

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg["type"]
        t0 = time.perf_counter()
        try:
            if kind == "add":
                out = self.enroller.add(msg.get("pod"))
            elif kind == "del":
                out = self.enroller.delete(msg.get("pod"))
            elif kind == "check":
                out = self.enroller.check(msg.get("pod"))
            elif kind == "list":
                out = self.list_page(msg.get("after"))
            elif kind == "status":
                ok, detail = self.readiness()
                out = {"ready": ok, **detail}
            else:
                raise EventError("bad_request", f"type={kind[:40]!r}: expected add, del, check, list or status")
        except BadPod as e:
            return self._failed(kind, msg, EventError("bad_request", str(e)))
        except EventError as e:
            return self._failed(kind, msg, e)
        except Exception as e:  # noqa: BLE001 - the plugin must always get an answer
            self.metrics.inc("failures", "internal")
            log.exception("%s failed", kind)
            return {"type": "result", "ok": False, "reason": "internal", "error": f"{type(e).__name__}: {e}"}
        if kind in ("add", "del"):
            self.metrics.inc("events", kind)
            if kind == "add" and out.get("enrolled"):
                self.metrics.observe_setup(time.perf_counter() - t0)
        return {"type": "result", "ok": True, "ms": round((time.perf_counter() - t0) * 1e3, 2), **out}

    def list_page(self, after: Any) -> dict[str, Any]:
        """A page of ``list``: the enrolled pods by uid after ``after`` (none: from the first), as many
        as fit in one message; ``next`` (the last uid of the page) when more follow."""
        if after is not None and not isinstance(after, str):
            raise EventError("bad_request", "after: expected a pod uid")
        reg = self.enroller.registry
        with reg.lock:
            pods = sorted((p for p in reg.pods.values() if after is None or p.uid > after), key=lambda p: p.uid)
            page: list[dict[str, Any]] = []
            size = 0
            for p in pods:
                item = p.for_proxy()
                n = len(json.dumps(item, separators=(",", ":"))) + 1
                if page and size + n > LIST_PAGE_BYTES:
                    return {"pods": page, "next": page[-1]["uid"]}
                page.append(item)
                size += n
        return {"pods": page}

    def _failed(self, kind: str, msg: dict[str, Any], e: EventError) -> dict[str, Any]:
        self.metrics.inc("failures", e.reason)
        pod = msg.get("pod")
        uid = pod.get("uid") if isinstance(pod, dict) and isinstance(pod.get("uid"), str) else None
        jlog(logging.ERROR, f"{kind[:40]} failed", reason=e.reason, error=str(e), pod=uid[:128] if uid else None)
        return {"type": "result", "ok": False, "reason": e.reason, "error": str(e)}
