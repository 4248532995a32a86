"""The agent's backend warm-up, and what ``/readyz`` says of the backend.

At start the agent pays its default backend's one-off costs before a pod waits for them: with the
eBPF backend the host programs are compiled, loaded, pinned and attached (once per node, by the
short-lived loader process, ``redirect.backends.ebpf.host.loader``: no compiler stays in the agent);
nftables is probed. ``auto`` warms eBPF up when it would choose eBPF for the default config; if
eBPF then cannot load or attach here, ``auto`` falls back for this process's pods
(``backends.ebpf_failed``) and the fallback is the backend in use.

The agent is ready (``/readyz``, the ``status`` message) only while its backend is usable: for
eBPF, while every host pin is in place, whoever loaded them (looked at on each probe: a pin
removed later makes it not ready until a pod's setup or the warm-up loads them again); a warm-up
that failed is tried again, less and less often (``RETRY_FIRST`` doubling up to ``RETRY_MAX``
seconds), until it succeeds or the agent stops, and until then the answer carries its error.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ...errors import BackendUnavailable
from .logs import jlog

#: Seconds before the first retry of a failed warm-up; each retry waits twice as long, up to RETRY_MAX.
RETRY_FIRST = 5.0
RETRY_MAX = 300.0


class Warmup:
    """The default backend's warm-up (``run``, a thread) and its part of the readiness (``readiness``)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        #: the backend pods get by default, once known (``auto`` resolved); None while warming up
        self.effective: str | None = None
        #: why the backend is not usable yet (the last warm-up's error)
        self.error: str | None = None
        self._lock = threading.Lock()
        if backend not in ("ebpf", "auto"):
            self._once()  # nothing slow to warm up (nftables: a probe): known before the agent serves

    def run(self, stopping: threading.Event) -> None:
        """Warm up until it succeeds or ``stopping`` is set (thread target)."""
        wait = RETRY_FIRST
        while not stopping.is_set():
            if self._once():
                return
            jlog(logging.WARNING, "backend warm-up failed; trying again", backend=self.backend, error=self.error,
                 retry_seconds=wait)
            if stopping.wait(wait):
                return
            wait = min(wait * 2, RETRY_MAX)

    def _once(self) -> bool:
        backend = self.backend
        auto = backend == "auto"
        if auto:
            from ...backends import choose_auto

            backend = choose_auto(None)
        error: str | None = None
        t0 = time.perf_counter()
        if backend == "ebpf":
            from ...backends import ebpf, ebpf_failed

            try:
                ebpf.host()
            except BackendUnavailable as e:
                if auto:
                    backend, error = ebpf_failed(str(e)), None  # auto's pods fall back at once
                else:
                    error = str(e)
            except Exception as e:  # noqa: BLE001 - reported on /readyz, tried again
                error = f"{type(e).__name__}: {e}"
            else:
                jlog(logging.INFO, "eBPF host programs ready", ms=round((time.perf_counter() - t0) * 1e3, 1))
        elif backend == "nftables":
            from ...backends.nftables import probe

            ok, why = probe()
            error = None if ok else f"backend='nftables': {why}"
        with self._lock:
            self.effective, self.error = backend, error
        return error is None

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(usable, the fields /readyz adds: ``backend``, and ``backend_error`` while not usable)."""
        with self._lock:
            effective, error = self.effective, self.error
        if "ebpf" in (self.backend, effective):  # usable once loaded and pinned, whoever loaded them
            from ...backends import ebpf, ebpf_root

            root = ebpf_root()
            missing = ebpf.missing_pins(root)
            if not missing:
                return True, {"backend": "ebpf"}
            if effective is not None:
                error = error or (f"ebpf: host pins missing under {root}: {', '.join(missing[:4])}"
                                  + (f" (+{len(missing) - 4})" if len(missing) > 4 else ""))
        if effective is None:
            return False, {"backend": self.backend, "backend_error": "warming up"}
        if error is not None:
            return False, {"backend": effective, "backend_error": error}
        return True, {"backend": effective}


__all__ = ["Warmup", "RETRY_FIRST", "RETRY_MAX"]
