"""Backends: each renders a ``Plan`` into kernel state in one network namespace.

``get_backend(name)`` accepts ``iptables`` (variant chosen per namespace),
``iptables-legacy``, ``iptables-nft``, and, where they are available, the others
registered here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import RedirectConfig
from ..errors import BackendUnavailable

log = logging.getLogger("redirect.backends")

BACKENDS = ("iptables", "iptables-legacy", "iptables-nft", "nftables", "auto")
#: Every kind of capture a netns may hold (a netns holds one: ``redirect.setup`` replaces another).
KINDS = ("iptables", "nftables", "ebpf")
#: The eBPF backend's pin root unless ``REDIRECT_BPF_ROOT`` names another.
EBPF_DEFAULT_ROOT = "/sys/fs/bpf/redirect"


def ebpf_root() -> str:
    """The eBPF backend's pin root now (``REDIRECT_BPF_ROOT``, else the default)."""
    return os.environ.get("REDIRECT_BPF_ROOT") or EBPF_DEFAULT_ROOT


def kind_of(backend_name: str) -> str:
    """The kind of capture a backend installs: ``iptables`` (either variant), ``nftables``, ``ebpf``."""
    return "iptables" if backend_name.startswith("iptables") else backend_name


def get_backend(name: str, cfg: RedirectConfig | None) -> Any:
    """The backend object for ``name``; ``BackendUnavailable`` names what is missing."""
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
        # nftables when libnftables imports and the kernel takes an inet nat table
        # (probed once per process), else iptables.
        from .nftables import NftablesBackend, probe

        ok, why = probe()
        if ok:
            log.info("backend=auto: chose nftables")
            return NftablesBackend()
        from .iptables import IptablesBackend

        log.info("backend=auto: chose iptables (%s)", why)
        return IptablesBackend()
    if name == "ebpf":
        from .ebpf import EbpfBackend

        return EbpfBackend(cfg)
    raise BackendUnavailable(f"backend={name!r}: unknown backend; choose one of {', '.join(BACKENDS)}")
