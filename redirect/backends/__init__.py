"""Backends: each renders a ``Plan`` into kernel state in one network namespace.

``get_backend(name)`` accepts ``iptables`` (variant chosen per namespace),
``iptables-legacy``, ``iptables-nft``, and, where they are available, the others
registered here.
"""

from __future__ import annotations

import logging

from ..config import RedirectConfig
from ..errors import BackendUnavailable
from .base import Backend, ebpf_root

log = logging.getLogger("redirect.backends")

BACKENDS = ("iptables", "iptables-legacy", "iptables-nft", "nftables", "ebpf", "auto")
#: Every kind of capture a netns may hold (a netns holds one: ``redirect.setup`` replaces another).
KINDS = ("iptables", "nftables", "ebpf")
def kind_of(backend_name: str) -> str:
    """The kind of capture a backend installs: ``iptables`` (either variant), ``nftables``, ``ebpf``."""
    return "iptables" if backend_name.startswith("iptables") else backend_name


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


def _netfilter_choice() -> tuple[str, str | None]:
    """``nftables`` when libnftables imports and the kernel takes an inet nat table, else
    ``iptables`` with the reason."""
    from .nftables import probe

    ok, why = probe()
    return ("nftables", None) if ok else ("iptables", why)


def choose_auto(cfg: RedirectConfig | None) -> str:
    """The backend ``auto`` stands for with ``cfg`` here (logged with the reason): ``ebpf`` when
    the kernel, bcc, bpffs and cgroup v2 allow it and the backend supports every option of
    ``cfg``; else ``nftables`` when libnftables imports and the kernel takes an inet nat table;
    else ``iptables``. (Probed once per process; with no ``cfg`` only the host decides.) A
    setup that finds eBPF unable to load or attach after all falls back the same way
    (``redirect.setup``, ``ebpf_failed``), and later choices of the process skip eBPF."""
    why: str | None = _ebpf_load_failures.get(ebpf_root())
    if why is not None:
        why = f"could not load or attach here earlier in this process: {why}"
    else:
        try:
            from . import ebpf
        except ImportError as e:  # the native module or bcc's bindings missing
            why = f"ebpf: {e}"
        else:
            why = ebpf.refusal(cfg if cfg is not None else RedirectConfig())
    if why is None:
        log.info("backend=auto: chose ebpf (the kernel allows it and it supports every option of the config)")
        return "ebpf"
    choice, nft_why = _netfilter_choice()
    if choice == "nftables":
        log.info("backend=auto: chose nftables, not ebpf (%s)", why)
    else:
        log.info("backend=auto: chose iptables, not ebpf (%s), not nftables (%s)", why, nft_why)
    return choice


def _netfilter_refusal(name: str, cfg: RedirectConfig | None) -> None:
    """``BackendUnavailable`` naming the option of ``cfg`` that only the eBPF backend implements
    (the mirror of the eBPF backend's ``entries._unsupported``); nothing is installed."""
    if cfg is not None and cfg.sockmap:
        raise BackendUnavailable(
            f"backend={name}: sockmap=True is not available with {kind_of(name)} (it pairs the two ends of a"
            " connection in a BPF sockmap, which only the eBPF backend installs); use backend=ebpf")


def get_backend(name: str, cfg: RedirectConfig | None) -> Backend:
    """The backend object for ``name``; ``BackendUnavailable`` names what is missing."""
    if name in ("iptables", "iptables-legacy", "iptables-nft", "nftables"):
        _netfilter_refusal(name, cfg)
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
        return get_backend(choose_auto(cfg), cfg)
    if name == "ebpf":
        from .ebpf import EbpfBackend

        return EbpfBackend(cfg)
    raise BackendUnavailable(f"backend={name!r}: unknown backend; choose one of {', '.join(BACKENDS)}")
