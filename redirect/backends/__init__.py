"""Backends: each renders a ``Plan`` into kernel state in one network namespace.

``get_backend(name)`` accepts ``iptables`` (variant chosen per namespace),
``iptables-legacy``, ``iptables-nft``, and, where they are available, the others
registered here.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import RedirectConfig
from ..errors import BackendUnavailable

log = logging.getLogger("redirect.backends")

BACKENDS = ("iptables", "iptables-legacy", "iptables-nft", "nftables", "auto")


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
