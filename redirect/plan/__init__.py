"""The plan layer: what to install, as pure data, computed from a ``RedirectConfig``.

Nothing here touches a kernel, so all of it is unit-testable without root.

``intent``
    What a config asks for, backend-neutral (``Intent``, ``AmbientIntent``).
``vocabulary``
    The typed netfilter-style vocabulary (``Plan``, chains, rules, matches, actions,
    ``ChainBuilder``) that the iptables and nftables backends render.
``sidecar``, ``ambient``
    The netfilter lowerings of a sidecar and of an ambient intent to a ``Plan``.
``lower_ebpf``
    The eBPF lowering of a sidecar intent to map entries.
``evaluate``
    Interpreters of a ``Plan`` and of eBPF entries (which packet goes where), for tests.

``build_plan`` below is the one entry point the backends and the API use.
"""

from __future__ import annotations

from ..config import RedirectConfig
from .intent import intent_of
from .sidecar import sidecar_plan
from .vocabulary import Plan


def build_plan(cfg: RedirectConfig) -> Plan:
    """The plan for ``cfg`` (dispatches on ``cfg.mode``)."""
    if cfg.mode == "ambient":
        from .ambient import build_ambient_plan  # (a sidecar's per-pod exec never loads it)

        return build_ambient_plan(cfg)
    return sidecar_plan(intent_of(cfg))
