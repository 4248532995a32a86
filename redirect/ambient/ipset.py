"""``ipset(8)``, run once per call in the calling thread's network namespace."""

from __future__ import annotations

import subprocess

from ..errors import SetupError


def run(args: list[str], stdin: str | None = None, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
    """Run ``ipset ARGS`` (``stdin`` fed to it, e.g. for ``restore``); ``SetupError`` when it is
    missing or exits with a code not in ``ok``."""
    try:
        p = subprocess.run(["ipset", *args], input=stdin, capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise SetupError("ipset not found; install Debian's 'ipset' package (apt-get install ipset)") from None
    if p.returncode not in ok:
        raise SetupError(f"ipset {' '.join(args)} failed (exit {p.returncode}): {p.stderr.strip()}")
    return p


__all__ = ["run"]
