"""Backends: each renders a ``Plan`` into kernel state in one network namespace.

``get_backend(name)`` accepts ``iptables`` (variant chosen per namespace),
``iptables-legacy``, ``iptables-nft``, and, where they are available, the others
registered here.
"""

from __future__ import annotations

from typing import Any

from ..config import RedirectConfig
from ..errors import BackendUnavailable

BACKENDS = ("iptables", "iptables-legacy", "iptables-nft")


def get_backend(name: str, cfg: RedirectConfig | None) -> Any:
    """The backend object for ``name``; ``BackendUnavailable`` names what is missing."""
    if name == "iptables":
        from .iptables import IptablesBackend

        return IptablesBackend()
    if name in ("iptables-legacy", "iptables-nft"):
        from .iptables import IptablesBackend

        return IptablesBackend(name.split("-", 1)[1])
    raise BackendUnavailable(f"backend={name!r}: unknown backend; choose one of {', '.join(BACKENDS)}")
