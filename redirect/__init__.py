"""redirect: capture a pod's traffic and hand it to a local proxy.

    import redirect
    redirect.setup("pod1")                              # Istio sidecar defaults
    redirect.setup("pod1", redirect.RedirectConfig(outbound_exclude_ports=(22,)))
    redirect.check("pod1", cfg)                         # CheckResult(ok, backend, differences)
    redirect.teardown("pod1")

``netns`` is ``"pid:N"`` (process N's), a path (it has a ``/``), else a name under
/run/netns (``"1"`` too); or ``redirect.Pid(n)``, ``redirect.Fd(n)``, or an int (an open
netns fd, else a pid). ``setup`` and ``teardown`` refuse the host's own netns unless
``allow_host_netns=True``.
"""

from __future__ import annotations

from .api import check, render, setup, show, teardown
from .backends.base import CheckResult, Installed
from .config import RedirectConfig
from .errors import BackendUnavailable, ConfigError, HostNetnsError, NetnsError, RedirectError, SetupError
from .kernel.netns import Fd, Pid


def __getattr__(name: str) -> str:
    if name == "__version__":  # looked up when asked (redirect.version)
        from .version import version

        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "setup",
    "teardown",
    "check",
    "show",
    "render",
    "RedirectConfig",
    "Installed",
    "CheckResult",
    "ConfigError",
    "BackendUnavailable",
    "SetupError",
    "NetnsError",
    "HostNetnsError",
    "RedirectError",
    "Pid",
    "Fd",
]
