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
    The eBPF lowering of an intent (sidecar or ambient) to map entries, and its kind table.
``evaluate``
    Interpreters of a ``Plan`` and of eBPF entries (which packet goes where), for tests.
``podnet``
    The connection and the pod they judge it in (``Conn``, ``PodNet``): locality, routing, sources.

``netfilter_plan(intent)`` below is what the iptables and nftables backends render (they are
given the intent, as every backend is); ``build_plan(cfg)`` is the same from a config, for tests
and tools.
"""

from __future__ import annotations

import functools

from ..config import RedirectConfig
from .intent import AmbientIntent, AnyIntent, intent_for
from .sidecar import sidecar_plan
from .vocabulary import Plan


@functools.lru_cache(maxsize=256)
def netfilter_plan(it: AnyIntent) -> Plan:
    """The netfilter lowering of ``it``, sidecar or ambient (cached: intents are frozen)."""
    if isinstance(it, AmbientIntent):
        from .ambient import ambient_plan  # (a sidecar's per-pod exec never loads it)

        return ambient_plan(it)
    return sidecar_plan(it)


def build_plan(cfg: RedirectConfig) -> Plan:
    """The netfilter plan of ``cfg`` (``netfilter_plan`` of its intent)."""
    return netfilter_plan(intent_for(cfg))


__all__ = ["build_plan", "netfilter_plan"]
