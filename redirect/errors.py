"""The exceptions redirect raises. Each message says what went wrong and what to do."""

from __future__ import annotations

import reprlib
from typing import Any

#: At most this many characters of a value are shown in an error message.
MAX_SHOWN = 200
_TRUNCATED = "...<truncated>"


class _Brief(reprlib.Repr):
    """``repr`` that looks at a bounded part of a value: a few items per container, a few
    levels deep, the start of each string. A value built from YAML aliases (one list
    referenced many times at every level) costs as little as a small one."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 8
        self.maxdict = 8
        self.maxstring = self.maxother = MAX_SHOWN

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:  # also: Python refuses str() of ints over 4300 digits
            return f"<int of {x.bit_length()} bits>"
        return repr(x)

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[: self.maxstring]) + (_TRUNCATED if len(x) > self.maxstring else "")

    def repr_bytearray(self, x: bytearray, level: int) -> str:
        return self.repr_bytes(bytes(x[: self.maxstring + 1]), level)

    def repr_instance(self, x: Any, level: int) -> str:
        try:
            s = repr(x)
        except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
            return f"<{type(x).__name__}>"
        return s


_brief = _Brief()


def brief(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` for a message: bounded in time and memory, at most ``limit`` characters
    (longer ones end in ``...<truncated>``)."""
    cut = False
    if isinstance(value, str):
        s = repr(value[:limit])
        cut = len(value) > limit
    else:
        try:
            s = _brief.repr(value)
        except RecursionError:
            s = f"<{type(value).__name__} nested too deeply>"
    if cut or len(s) > limit:
        s = s[:limit] + _TRUNCATED
    return s


def brief_text(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` itself (not its repr) cut to ``limit`` characters, for names and paths."""
    return text if len(text) <= limit else text[:limit] + _TRUNCATED


class RedirectError(Exception):
    """Base class of every error redirect raises on purpose."""


class ConfigError(RedirectError, ValueError):
    """A configuration value is invalid. ``field`` and ``value`` name it.

    The message shows at most ``MAX_SHOWN`` characters of the field and of the value
    (``...<truncated>`` marks the cut); ``value`` itself is kept as given."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{brief_text(str(field), 100)}={brief(value)}: {brief_text(reason, 2 * MAX_SHOWN)}")


class BackendUnavailable(RedirectError):
    """A backend (or a feature of one) can't run here; the message says what is missing."""


class SetupError(RedirectError):
    """Installing or removing redirection failed; the namespace was left as it was."""


class NetnsError(RedirectError):
    """A network namespace could not be found or entered."""


class HostNetnsError(NetnsError):
    """``setup`` or ``teardown`` was pointed at the host's own network namespace and not told that is meant."""


class NotBuilt(RedirectError, ImportError):
    """A part the package build makes (``redirect._native``, the compiled helpers) is missing from
    this copy of redirect, or does not load; the message says how to get it."""
