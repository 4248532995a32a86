"""What answers a message on the events socket: ``add``, ``del``, ``check``, ``list``, ``status``.

``Dispatcher.handle`` is the events server's handler (``events.EventServer``): it never raises,
every failure is a ``result`` with ``ok: false``, a ``reason`` (also the failure metric's label)
and an ``error`` that names the field and the value. Wire format: docs/agent-protocol.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .enroller import Enroller, EventError
from .logs import jlog, log
from .metrics import Metrics
from .pods import BadPod


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
                reg = self.enroller.registry
                with reg.lock:
                    out = {"pods": [p.for_proxy() for p in reg.pods.values()]}
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

    def _failed(self, kind: str, msg: dict[str, Any], e: EventError) -> dict[str, Any]:
        self.metrics.inc("failures", e.reason)
        pod = msg.get("pod")
        uid = pod.get("uid") if isinstance(pod, dict) and isinstance(pod.get("uid"), str) else None
        jlog(logging.ERROR, f"{kind[:40]} failed", reason=e.reason, error=str(e), pod=uid[:128] if uid else None)
        return {"type": "result", "ok": False, "reason": e.reason, "error": str(e)}
