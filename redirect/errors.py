"""The exceptions redirect raises. Each message says what went wrong and what to do."""

from __future__ import annotations


class RedirectError(Exception):
    """Base class of every error redirect raises on purpose."""


class ConfigError(RedirectError, ValueError):
    """A configuration value is invalid. ``field`` and ``value`` name it."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={value!r}: {reason}")


class BackendUnavailable(RedirectError):
    """A backend (or a feature of one) can't run here; the message says what is missing."""


class SetupError(RedirectError):
    """Installing or removing redirection failed; the namespace was left as it was."""


class NetnsError(RedirectError):
    """A network namespace could not be found or entered."""
