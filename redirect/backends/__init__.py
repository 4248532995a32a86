"""Backends: each renders a ``Plan`` into kernel state in one network namespace.

``get_backend(name)`` accepts ``iptables`` (variant chosen per namespace),
``iptables-legacy``, ``iptables-nft``, and, where they are available, the others
registered here.
"""

from __future__ import annotations

import logging
import os

from ..errors import BackendUnavailable
from ..plan.intent import AnyIntent
from .base import Backend, ebpf_root, kind_of, refuse

__all__ = ["BACKENDS", "KINDS", "Backend", "kind_of", "refuse", "get_backend", "choose_auto", "ebpf_failed",
           "ebpf_caps_refusal", "ebpf_root"]

log = logging.getLogger("redirect.backends")

BACKENDS = ("iptables", "iptables-legacy", "iptables-nft", "nftables", "ebpf", "auto")
#: Every kind of capture a netns may hold (a netns holds one: ``redirect.setup`` replaces another).
KINDS = ("iptables", "nftables", "ebpf")


#: Per eBPF pin root: why eBPF could not load or attach in this process although the host probe
#: allowed it (``ebpf_failed``); ``choose_auto`` then skips eBPF for the rest of the process.
_ebpf_load_failures: dict[str, str] = {}


def ebpf_failed(why: str) -> str:
    """Record that eBPF could not load or attach here (on the current pin root), for ``auto``'s
    later choices in this process; the backend ``auto`` falls back to (logged with ``why``)."""
    _ebpf_load_failures[ebpf_root()] = why
    fallback, nft_why = _netfilter_choice()
    if fallback == "nftables":
        log.warning("backend=auto: chose nftables, not ebpf (could not load or attach here: %s)", why)
    else:
        log.warning("backend=auto: chose iptables, not ebpf (could not load or attach here: %s), not nftables (%s)",
                    why, nft_why)
    return fallback


#: The answer of ``ebpf_caps_refusal`` in a one-item list, once asked: a process's capabilities
#: stay as they started (forgotten in a forked child, which asks again).
_ebpf_caps: list[str | None] | None = None


def _forget_ebpf_caps() -> None:
    global _ebpf_caps
    _ebpf_caps = None


os.register_at_fork(after_in_child=_forget_ebpf_caps)


def ebpf_caps_refusal() -> str | None:
    """Why this process can't install eBPF capture for want of a capability (None: it has them).
    Every setup needs ``CAP_BPF`` (map entries; ``CAP_SYS_ADMIN`` stands for it) and
    ``CAP_NET_ADMIN`` (the pod's sk_lookup link); loading the host programs needs ``CAP_PERFMON``
    too. An init container with ``NET_ADMIN`` and ``NET_RAW`` has neither the first nor the host's
    bpffs: the node agent installs eBPF capture, not a pod. Asked once per process."""
    global _ebpf_caps
    if _ebpf_caps is None:
        _ebpf_caps = [_ebpf_caps_refusal()]
    return _ebpf_caps[0]


def _ebpf_caps_refusal() -> str | None:
    from ..kernel.caps import effective

    eff = effective()
    lacking = [f"CAP_{c}" for c in ("BPF", "NET_ADMIN") if c not in eff and not (c == "BPF" and "SYS_ADMIN" in eff)]
    if not lacking:
        return None
    return (f"ebpf: this process lacks {' and '.join(lacking)}: the eBPF backend needs CAP_BPF (or CAP_SYS_ADMIN) and"
            f" CAP_NET_ADMIN, CAP_PERFMON too to load its host programs, and the host's bpffs; run it where the node"
            f" agent runs, or use iptables or nftables")


def _netfilter_choice() -> tuple[str, str | None]:
    """``nftables`` when libnftables imports and the kernel takes an inet nat table, else
    ``iptables`` with the reason."""
    from .nftables import probe

    ok, why = probe()
    return ("nftables", None) if ok else ("iptables", why)


def choose_auto(it: AnyIntent | None) -> str:
    """The backend ``auto`` stands for with intent ``it`` here (logged with the reason): ``ebpf``
    when this process's capabilities, the kernel, bcc, bpffs and cgroup v2 allow it and the
    backend lowers every option of ``it`` (``redirect.plan.intent.refusals``); else ``nftables``
    when libnftables imports and the kernel takes an inet nat table; else ``iptables``. (Probed
    once per process; with no ``it`` only the host decides.) A setup that finds eBPF unable to
    load or attach after all falls back the same way (``redirect.setup``, ``ebpf_failed``), and
    later choices of the process skip eBPF."""
    why: str | None = _ebpf_load_failures.get(ebpf_root())
    if why is not None:
        why = f"could not load or attach here earlier in this process: {why}"
    else:
        why = ebpf_caps_refusal()
    if why is None:
        try:
            from . import ebpf
        except ImportError as e:  # the native module or bcc's bindings missing
            why = f"ebpf: {e}"
        else:
            why = ebpf.refusal(it)
    if why is None:
        log.info("backend=auto: chose ebpf (the kernel allows it and it supports every option of the config)")
        return "ebpf"
    choice, nft_why = _netfilter_choice()
    if choice == "nftables":
        log.info("backend=auto: chose nftables, not ebpf (%s)", why)
    else:
        log.info("backend=auto: chose iptables, not ebpf (%s), not nftables (%s)", why, nft_why)
    return choice


def get_backend(name: str, it: AnyIntent | None = None) -> Backend:
    """The backend object for ``name`` (``auto``: the one it stands for with intent ``it``);
    ``BackendUnavailable`` names what is missing."""
    if it is not None and name != "auto":
        refuse(it, name)
    if name == "iptables":
        from .iptables import IptablesBackend

        return IptablesBackend()
    if name in ("iptables-legacy", "iptables-nft"):
        from .iptables import IptablesBackend

        return IptablesBackend(name.split("-", 1)[1])
    if name == "nftables":
        from .nftables import NftablesBackend, probe

        ok, why = probe()
        if not ok:
            raise BackendUnavailable(f"backend='nftables': {why}")
        return NftablesBackend()
    if name == "auto":
        return get_backend(choose_auto(it), it)
    if name == "ebpf":
        from .ebpf import EbpfBackend

        return EbpfBackend()
    raise BackendUnavailable(f"backend={name!r}: unknown backend; choose one of {', '.join(BACKENDS)}")
