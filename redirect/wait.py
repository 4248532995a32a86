"""``redirect wait``: block until the proxy answers and capture is in place, or time out.

The ``postStart`` hook that holds a pod's application until its proxy is ready (Istio's
``pilot-agent wait``, which ``holdApplicationUntilProxyStarts`` injects): the kubelet
starts the next container only once the hook returns, and a hook that fails kills the
container. Each round (every ``period`` seconds, until ``timeout``) checks, in order:

1. with a netns, the capture installed there equals the config, as ``redirect check``
   compares it (reading the rules needs ``CAP_NET_ADMIN`` in that netns: a proxy
   container running as uid 1337 without it can't, and there the init container that
   installed capture has already failed closed if it could not);
2. with ``validate``, the validation probe of ``redirect init --run-validation`` (it
   listens on the inbound capture port, so run it before the proxy listens there);
3. with a URL, ``GET`` answers 200 (Istio's proxy: ``http://localhost:15020/healthz/ready``).

It returns once one round passes them all; the result names what was not ready last.
Only ``http://`` URLs are probed, without any ``http_proxy`` from the environment.
"""

from __future__ import annotations

import http.client
import time
import urllib.parse
from dataclasses import dataclass

from .config import RedirectConfig
from .errors import BackendUnavailable, ConfigError, RedirectError
from .kernel import netns as _netns

#: Istio's proxy readiness URL (pilot-agent's status port).
DEFAULT_URL = "http://localhost:15020/healthz/ready"
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_PERIOD_MS = 500
MAX_TIMEOUT_S = 24 * 3600.0


@dataclass(frozen=True)
class WaitResult:
    """``ok``: everything was ready in one round; ``reason``: what was not, in the last round."""

    ok: bool
    reason: str
    seconds: float
    rounds: int


def parse_url(url: str) -> tuple[str, int, str]:
    """``(host, port, path)`` of an ``http://`` URL; ``ConfigError`` naming ``--url`` otherwise."""
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port or 80
    except ValueError as e:
        raise ConfigError("--url", url, f"not a URL: {e}") from None
    if u.scheme != "http" or not u.hostname:
        raise ConfigError("--url", url, "expected http://HOST[:PORT]/PATH")
    path = u.path or "/"
    return u.hostname, port, path + (f"?{u.query}" if u.query else "")


def probe_url(url: str, timeout: float) -> str | None:
    """None when ``GET url`` answers 200, else why not."""
    host, port, path = parse_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"User-Agent": "redirect-wait"})
        resp = conn.getresponse()
        resp.read(65536)
        return None if resp.status == 200 else f"{url} answered {resp.status} {resp.reason}"
    except (OSError, http.client.HTTPException) as e:
        return f"{url}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
    finally:
        conn.close()


def probe_capture(netns: _netns.NetnsRef, cfg: RedirectConfig, backend: str | None = None) -> str | None:
    """None when the capture installed in ``netns`` equals ``cfg`` (``redirect.check``: ``backend``
    None compares with whatever backend's capture is installed there), else why not."""
    from . import api

    try:
        res = api.check(netns, cfg, backend=backend)
    except (ConfigError, BackendUnavailable):
        raise
    except RedirectError as e:
        return f"capture in {_netns.describe(netns)}: {e}"
    if res.ok:
        return None
    shown = "; ".join(res.differences[:3]) + ("; ..." if len(res.differences) > 3 else "")
    return f"capture in {_netns.describe(netns)} differs from the config ({res.backend}, " \
           f"{len(res.differences)} difference(s)): {shown}"


def probe_validation(netns: _netns.NetnsRef, cfg: RedirectConfig, probe_port: int, timeout: float) -> str | None:
    from .istio.validation import validate_outbound

    ok, msg = validate_outbound(netns, cfg, probe_port, timeout)
    return None if ok else msg


def wait(
    url: str | None = DEFAULT_URL,
    netns: _netns.NetnsRef | None = None,
    config: RedirectConfig | None = None,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    period: float = DEFAULT_PERIOD_MS / 1000,
    validate: bool = False,
    probe_port: int = 15002,
) -> WaitResult:
    """Check every ``period`` s until one round passes (see the module docstring) or ``timeout`` s pass.

    Raises ``ConfigError`` for a bad URL, timeout or period, and ``BackendUnavailable``
    (not worth waiting for); everything else is "not ready yet".
    """
    if not url and netns is None:
        raise ConfigError("--url", url, "nothing to wait for: give a URL, a netns, or both")
    if url:
        parse_url(url)
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ConfigError("--timeout", timeout, f"expected seconds in (0, {MAX_TIMEOUT_S:.0f}]")
    if not 0.001 <= period <= 60:
        raise ConfigError("--period-ms", round(period * 1000), "expected 1..60000 milliseconds")
    if validate and netns is None:
        raise ConfigError("--validate", True, "needs --netns")
    cfg = config if config is not None else RedirectConfig()
    t0 = time.monotonic()
    deadline = t0 + timeout
    rounds = 0
    while True:
        rounds += 1
        left = max(0.05, deadline - time.monotonic())
        reason: str | None = None
        if netns is not None:
            reason = probe_capture(netns, cfg, backend)
            if reason is None and validate:
                reason = probe_validation(netns, cfg, probe_port, min(left, 5.0))
        if reason is None and url:
            reason = probe_url(url, min(left, 2.0))
        now = time.monotonic()
        if reason is None:
            return WaitResult(True, "ready", now - t0, rounds)
        if now >= deadline:
            return WaitResult(False, reason, now - t0, rounds)
        time.sleep(min(period, deadline - now))


__all__ = ["DEFAULT_URL", "WaitResult", "parse_url", "probe_url", "probe_capture", "wait"]
