"""Kubernetes/Istio pod annotations -> ``RedirectConfig``.

The annotation names are Istio's (``istio.io/api`` ``annotation`` package, as
read by ``istio-cni``'s ``sidecar_redirect.go``); each maps onto one field:

=====================================================  ===========================
annotation                                             field
=====================================================  ===========================
``traffic.sidecar.istio.io/includeOutboundIPRanges``   ``outbound_cidrs`` (``*`` ok)
``traffic.sidecar.istio.io/excludeOutboundIPRanges``   ``outbound_exclude_cidrs``
``traffic.sidecar.istio.io/includeInboundPorts``       ``inbound_ports`` (``*`` ok)
``traffic.sidecar.istio.io/excludeInboundPorts``       ``inbound_exclude_ports`` (+15020,15021,15090)
``traffic.sidecar.istio.io/includeOutboundPorts``      ``outbound_ports``
``traffic.sidecar.istio.io/excludeOutboundPorts``      ``outbound_exclude_ports``
``traffic.sidecar.istio.io/excludeInterfaces``         ``exclude_interfaces``
``istio.io/reroute-virtual-interfaces``                ``reroute_interfaces``
``traffic.sidecar.istio.io/kubevirtInterfaces``        ``reroute_interfaces`` (deprecated alias;
                                                       used only without the one above)
``sidecar.istio.io/interceptionMode``                  ``inbound_interception``
                                                       (``REDIRECT``/``TPROXY``; ``NONE`` = no capture)
``sidecar.istio.io/proxyUID``                          ``proxy_uids``
``sidecar.istio.io/proxyGID``                          ``proxy_gids``
``status.sidecar.istio.io/port``                       added to ``inbound_exclude_ports``
``sidecar.istio.io/inject``                            ``"false"``: the pod is not captured
=====================================================  ===========================

Istio itself takes the proxy UID/GID from the ``istio-proxy`` container's
``securityContext.runAsUser``/``runAsGroup`` (a Kubernetes API lookup) and falls
back to 1337. Without an API server we read them from ``sidecar.istio.io/proxyUID``
and ``sidecar.istio.io/proxyGID`` instead; those two keys are ours, not Istio's.

Like Istio, the proxy's own ports 15020, 15021 and 15090 are always excluded from
inbound capture, whatever ``excludeInboundPorts`` says. Unknown annotations are
ignored (a pod carries many). A bad value raises ``ConfigError`` whose ``field`` is
the annotation's name and whose ``value`` is the annotation's value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import RedirectConfig
from ..errors import ConfigError

INJECT = "sidecar.istio.io/inject"
INTERCEPTION_MODE = "sidecar.istio.io/interceptionMode"
STATUS_PORT = "status.sidecar.istio.io/port"
PROXY_UID = "sidecar.istio.io/proxyUID"
PROXY_GID = "sidecar.istio.io/proxyGID"
REROUTE = "istio.io/reroute-virtual-interfaces"
KUBEVIRT = "traffic.sidecar.istio.io/kubevirtInterfaces"
#: Ours: what ``redirect inject`` added to the pod (its init container installs the pod's capture).
INJECTED = "redirect/inject-status"

_T = "traffic.sidecar.istio.io/"
#: Annotation -> RedirectConfig field, for the ones that map one to one.
FIELDS: dict[str, str] = {
    _T + "includeOutboundIPRanges": "outbound_cidrs",
    _T + "excludeOutboundIPRanges": "outbound_exclude_cidrs",
    _T + "includeInboundPorts": "inbound_ports",
    _T + "excludeInboundPorts": "inbound_exclude_ports",
    _T + "includeOutboundPorts": "outbound_ports",
    _T + "excludeOutboundPorts": "outbound_exclude_ports",
    _T + "excludeInterfaces": "exclude_interfaces",
    REROUTE: "reroute_interfaces",
    PROXY_UID: "proxy_uids",
    PROXY_GID: "proxy_gids",
}
#: Every annotation this module reads.
KNOWN: tuple[str, ...] = (*FIELDS, KUBEVIRT, INTERCEPTION_MODE, STATUS_PORT, INJECT)

ALWAYS_EXCLUDED_INBOUND = (15020, 15021, 15090)
_STAR_FIELDS = {"outbound_cidrs", "inbound_ports"}


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(name, value, "annotation values are strings")
    return value.strip()


def wants_capture(annotations: Mapping[str, Any]) -> bool:
    """False when the pod opts out: ``sidecar.istio.io/inject: "false"`` or interception ``NONE``."""
    inject = annotations.get(INJECT)
    if inject is not None and _text(INJECT, inject).lower() in ("false", "0", "no", "off"):
        return False
    mode = annotations.get(INTERCEPTION_MODE)
    return not (mode is not None and _text(INTERCEPTION_MODE, mode).upper() == "NONE")


def injected(annotations: Mapping[str, Any]) -> bool:
    """True when ``redirect inject`` gave the pod its init container (``redirect/inject-status``):
    that container installs the pod's capture, so the CNI plugin leaves the pod alone (as Istio's
    CNI plugin leaves alone the pods its injector gave an init container)."""
    return INJECTED in annotations


def config_from_annotations(
    annotations: Mapping[str, Any], base: RedirectConfig | None = None
) -> RedirectConfig:
    """``base`` (Istio's defaults when None) with the pod's annotations applied.

    Raises ``ConfigError`` naming the annotation and its value when one is bad, or
    when the combination is invalid (then the first annotation involved is named).
    """
    if not isinstance(annotations, Mapping):
        raise ConfigError("annotations", annotations, "must be a mapping of annotation names to strings")
    cfg = base if base is not None else RedirectConfig()
    changes: dict[str, Any] = {}
    origin: dict[str, str] = {}  # field -> annotation that set it

    def put(field: str, ann: str, value: Any) -> None:
        # Validate each annotation on its own first, so the error names exactly it.
        try:
            cfg.replace(**{field: value})
        except ConfigError as e:
            raise ConfigError(ann, annotations[ann], e.reason) from None
        changes[field] = value
        origin[field] = ann

    for ann, field in FIELDS.items():
        if ann not in annotations:
            continue
        raw = _text(ann, annotations[ann])
        if field in _STAR_FIELDS and raw == "*":
            put(field, ann, "*")
        else:
            put(field, ann, raw)
    if REROUTE not in annotations and KUBEVIRT in annotations:
        put("reroute_interfaces", KUBEVIRT, _text(KUBEVIRT, annotations[KUBEVIRT]))

    if INTERCEPTION_MODE in annotations:
        mode = _text(INTERCEPTION_MODE, annotations[INTERCEPTION_MODE]).upper()
        if mode == "NONE":
            pass  # wants_capture() says no; nothing to configure
        elif mode in ("REDIRECT", "TPROXY"):
            put("inbound_interception", INTERCEPTION_MODE, mode)
        else:
            raise ConfigError(INTERCEPTION_MODE, annotations[INTERCEPTION_MODE],
                              'expected "REDIRECT", "TPROXY" or "NONE"')

    # Istio always keeps the proxy's own ports (and the status port) out of inbound capture.
    extra: list[int] = list(ALWAYS_EXCLUDED_INBOUND)
    if STATUS_PORT in annotations:
        raw = _text(STATUS_PORT, annotations[STATUS_PORT])
        try:
            port = cfg.replace(inbound_exclude_ports=raw).inbound_exclude_ports
        except ConfigError as e:
            raise ConfigError(STATUS_PORT, annotations[STATUS_PORT], e.reason) from None
        if len(port) != 1:
            raise ConfigError(STATUS_PORT, annotations[STATUS_PORT], "expected one port")
        extra.extend(port)
    if "inbound_exclude_ports" in changes or STATUS_PORT in annotations:
        current = cfg.replace(inbound_exclude_ports=changes.get("inbound_exclude_ports", cfg.inbound_exclude_ports))
        merged = list(current.inbound_exclude_ports)
        merged += [p for p in extra if p not in merged]
        changes["inbound_exclude_ports"] = tuple(merged)
        origin.setdefault("inbound_exclude_ports", STATUS_PORT)

    if not changes:
        return cfg
    try:
        return cfg.replace(**changes)
    except ConfigError as e:
        ann = origin.get(e.field, e.field)
        raise ConfigError(ann, annotations.get(ann, e.value), e.reason) from None


__all__ = ["config_from_annotations", "wants_capture", "FIELDS", "KNOWN"]
