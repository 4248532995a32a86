"""The log format of every ``redirect`` executable: text, or one JSON object per line.

``redirect``, ``redirect-cni``, ``redirect-agent`` and ``redirect-nodeproxy`` all take
``--log-json`` (the CNI plugin, run by a runtime without arguments, takes
``"logJson": true`` in its network config) and set their logging up through
:func:`setup`. A JSON line holds, in this order:

``time``
    RFC 3339 in UTC with milliseconds, ``2026-01-02T03:04:05.678Z`` (Istio's
    ``--log_as_json`` key);
``level``
    ``debug``, ``info``, ``warning``, ``error`` or ``critical``;
``logger``
    the Python logger, e.g. ``redirect.cni``;
``msg``
    the message;
the pod's fields where known
    ``pod_name``, ``pod_namespace``, ``pod_uid``, ``container_id``, ``netns``: given to
    :func:`setup` once per process (the CNI plugin takes them from ``CNI_ARGS``; a
    container started by ``redirect inject``'s manifests gets ``POD_NAME``,
    ``POD_NAMESPACE`` and ``POD_UID`` from the downward API: :func:`pod_fields_from_env`);
the record's own fields
    ``log.info(msg, extra={"fields": {...}})`` (see :func:`log_fields`);
``exc``
    the traceback, when there is one.

A newline inside a message or a field stays inside its JSON string (in text lines the
message's control characters are escaped as ``\\xNN`` and fields are JSON strings), so one
record is always one line. Pod fields come from what a pod controls (its name, annotations):
each is cut to :data:`MAX_FIELD` characters.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

#: The pod's fields, in the order they appear in a line.
POD_FIELDS = ("pod_name", "pod_namespace", "pod_uid", "container_id", "netns")
#: Longest pod field value kept (the rest is cut, with a marker).
MAX_FIELD = 256
#: The downward-API environment variables that name the pod a process runs in.
POD_ENV = {"POD_NAME": "pod_name", "POD_NAMESPACE": "pod_namespace", "POD_UID": "pod_uid"}

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Control characters, escaped in text lines.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _bounded(value: object) -> str:
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= MAX_FIELD else s[:MAX_FIELD] + "...(cut)"


def pod_fields(**fields: object) -> dict[str, str]:
    """The known pod fields among ``fields`` (empty and None values dropped), bounded in size."""
    unknown = set(fields) - set(POD_FIELDS)
    if unknown:
        raise ValueError(f"not a pod field: {sorted(unknown)}; expected some of {POD_FIELDS}")
    return {k: _bounded(fields[k]) for k in POD_FIELDS if fields.get(k) not in (None, "")}


def pod_fields_from_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Pod fields from the downward-API variables ``POD_NAME``, ``POD_NAMESPACE``, ``POD_UID``."""
    env = os.environ if env is None else env
    return pod_fields(**{field: env.get(var) for var, field in POD_ENV.items()})


def timestamp(created: float) -> str:
    """``created`` (seconds since the epoch) as RFC 3339 UTC with milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def record_dict(created: float, level: str, logger: str, msg: str, pod: Mapping[str, str] | None = None,
                fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One line's object, keys in the documented order (a record field never replaces a fixed key)."""
    out: dict[str, Any] = {"time": timestamp(created), "level": level, "logger": logger, "msg": msg}
    for k, v in (pod or {}).items():
        out.setdefault(k, v)
    for k, v in (fields or {}).items():
        out.setdefault(k, v)
    return out


def json_line(level: str, logger: str, msg: str, pod: Mapping[str, str] | None = None,
              fields: Mapping[str, Any] | None = None, created: float | None = None) -> str:
    """One JSON log line (no newline), for writers that do not go through ``logging``."""
    obj = record_dict(time.time() if created is None else created, level, logger, msg, pod, fields)
    return json.dumps(obj, default=str, ensure_ascii=False)


class JsonFormatter(logging.Formatter):
    """Formats a ``logging`` record as one JSON line; ``pod`` fields are added to every line."""

    def __init__(self, pod: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.pod = dict(pod or {})

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        obj = record_dict(record.created, record.levelname.lower(), record.name, record.getMessage(), self.pod,
                          fields if isinstance(fields, Mapping) else None)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The text form: ``fmt``, then the pod's and the record's fields as ``key=value``."""

    def __init__(self, fmt: str = TEXT_FORMAT, pod: Mapping[str, str] | None = None) -> None:
        super().__init__(fmt)
        self.pod = dict(pod or {})

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        # What a pod controls (a container id, a name) may hold a newline: it never starts a line.
        if _CONTROL.search(record.message):
            record.message = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        extra = {**self.pod, **(fields if isinstance(fields, Mapping) else {})}
        if extra:
            text += " " + " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in extra.items())
        return text


def log_fields(logger: logging.Logger, level: int, msg: str, /, **fields: Any) -> None:
    """``msg`` with structured ``fields`` (keys in the JSON line; ``key=value`` in text)."""
    logger.log(level, msg, extra={"fields": fields})


_HANDLER_NAME = "redirect.logjson"


def _trusted_dirs(path: str) -> None:
    """``OSError`` unless nobody but this user (root) can change what ``path``'s directory part
    leads to: every symlink on the way is this user's, and every directory it ends up in is this
    user's (or root's) and not writable by others, or sticky (where others may add entries but not replace
    this user's). So the file is opened where the caller meant, not where another user's
    symlink or directory sends it, and nothing can be swapped between this check and the open."""
    me = os.geteuid()
    parts = [p for p in os.path.abspath(path).split("/")[:-1] if p]
    cur = "/"
    for name in parts:
        nxt = os.path.join(cur, name)
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode) and st.st_uid != me:
            raise OSError(f"log file {path!r}: {nxt} is a symlink of uid {st.st_uid}, not of this user")
        cur = nxt
    real = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    d = "/"
    for name in [p for p in real.split("/") if p] + [""]:
        st = os.stat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"log file {path!r}: {d} is not a directory")
        if st.st_uid != me and st.st_uid != 0:
            raise OSError(f"log file {path!r}: directory {d} is owned by uid {st.st_uid}")
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise OSError(f"log file {path!r}: directory {d} is writable by others")
        if name:
            d = os.path.join(d, name)


def open_log_file(path: str) -> IO[str]:
    """``path`` for appending: created with mode 0600, never through a symlink of another user or
    in a directory another user controls (root writes logs, often where others may create
    entries: ``_trusted_dirs``); an existing one must be a regular file of this user's, and
    loses any access of group and others. A FIFO or a device is refused without waiting or
    side effects: looked at first, then opened without blocking and checked again. ``OSError``
    otherwise."""
    _trusted_dirs(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"log file {path!r}: not a regular file")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                 | os.O_NOCTTY, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"log file {path!r}: not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(f"log file {path!r}: owned by uid {st.st_uid}, not by this user")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


class _FileHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Appends to a file opened by ``open_log_file``; ``close`` closes it."""

    def __init__(self, path: str) -> None:
        super().__init__(open_log_file(path))

    def close(self) -> None:
        self.acquire()
        try:
            if not self.stream.closed:
                self.stream.close()
        finally:
            self.release()
        super().close()


def setup(
    *,
    json_lines: bool,
    level: int | str = logging.WARNING,
    logger: str = "redirect",
    stream: IO[str] | None = None,
    path: str | None = None,
    pod: Mapping[str, str] | None = None,
    text_format: str = TEXT_FORMAT,
) -> logging.Handler:
    """Send ``logger``'s records (``redirect`` and below) to ``path`` or ``stream`` (stderr).

    ``json_lines`` picks the format. ``pod`` fields are added to every line. A file is
    opened for appending by ``open_log_file`` (mode 0600: logs name pods and addresses; no
    symlinks).
    Replaces the handlers this function added before, so calling it twice does not
    print every line twice. Returns the handler.
    """
    handler: logging.Handler
    if path is not None:
        handler = _FileHandler(path)
    else:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(pod) if json_lines else TextFormatter(text_format, pod))
    handler.set_name(_HANDLER_NAME)
    log = logging.getLogger(logger)
    for old in [h for h in log.handlers if h.get_name() == _HANDLER_NAME]:
        log.removeHandler(old)
        old.close()
    log.addHandler(handler)
    log.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


__all__ = ["JsonFormatter", "TextFormatter", "POD_FIELDS", "json_line", "log_fields", "pod_fields",
           "pod_fields_from_env", "record_dict", "setup", "timestamp"]
