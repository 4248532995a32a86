"""The agent's logger and its one structured-log helper (the JSON line's format: ``redirect.logjson``)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("redirect.agent")


def jlog(level: int, msg: str, **fields: Any) -> None:
    """A structured log line: ``msg`` plus ``fields`` (keys of the JSON line, see ``redirect.logjson``)."""
    log.log(level, msg, extra={"fields": fields})


__all__ = ["log", "jlog"]
