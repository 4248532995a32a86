"""``redirect-cni install`` / ``uninstall``: put our plugin into a node's CNI config.

``install`` appends our entry (``plugin_entry``: every setting written out, so the node's
config shows what is in force) to the ``plugins`` of the conf dir's active network
config (the first ``*.conf``/``*.conflist``/``*.json`` by name, as libcni picks it),
and writes two executables into the bin dir: ``redirect-cni``, the thin plugin
(``native/cni_thin.c``: it hands every request to ``redirect-agent``, which runs the
plugin code in its long-lived process), and ``redirect-cni-python``, a launcher of the
Python plugin (``redirect.cni.plugin``) that the thin one execs when no agent runs and
its config says ``"agentDown": "inProcess"``. It edits the file's text in
place, so every other plugin, key order, indentation and the file mode stay as they
were, and ``uninstall`` takes out exactly what ``install`` put in: the round trip
gives back the original bytes. A single-plugin ``.conf`` becomes a ``.conflist``
(libcni's conversion: the plugin is the list's first entry; refused when a file of that
name exists: it is not ours); our entry then carries the original file
(``redirectInstall.original``), so ``uninstall`` restores it byte for byte (a file it
cannot read or undo is left as it is, with a warning). Every write is atomic (temp file in the same dir + rename); our
entry is never duplicated (an outdated one is replaced).

``install --standalone NAME`` writes a conflist of our own instead (optionally with
``--primary`` plugins before ours). ``install --watch`` (with any of those options and
``--python``) keeps our entry and our two executables present: it polls the conf dir
and the bin dir and re-adds the entry when another tool rewrites the file, and the
binaries when they are removed or replaced, until SIGTERM/SIGINT or ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..config import seconds_arg
from ..errors import brief_text
from ..version import VersionAction
from .netconf import DEFAULTS, LATEST, PLUGIN_TYPE, CniError, PluginConf

DEFAULT_CONF_DIR = "/etc/cni/net.d"
DEFAULT_BIN_DIR = "/opt/cni/bin"
CONF_EXTS = (".conf", ".conflist", ".json")
MARK_KEY = "redirectInstall"
LAUNCHER_MARK = "# redirect-cni launcher"
PYTHON_PLUGIN = "redirect-cni-python"
#: the thin plugin where the package build (``setup.py``) puts it, and the string it carries
THIN_BINARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "redirect-cni-thin")
THIN_MARK = b"redirect-cni thin plugin (written by `redirect-cni install`)"
#: The capabilities our entry declares: the runtime passes the pod's annotations.
CAPABILITIES = {"io.kubernetes.cri.pod-annotations": True}


class InstallError(Exception):
    """Installing or removing our entry failed; the message names the file."""


# --- a JSON scanner that keeps positions ---------------------------------------------------


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _string_end(s: str, i: int) -> int:
    j = i + 1
    while s[j] != '"':
        j += 2 if s[j] == "\\" else 1
    return j + 1


def _value_end(s: str, i: int) -> int:
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while True:
            ch = s[j]
            if ch == '"':
                j = _string_end(s, j)
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
    j = i
    while j < len(s) and s[j] not in ",]} \t\r\n":
        j += 1
    return j


def _members(s: str) -> dict[str, tuple[int, int]]:
    """Top-level object keys -> (start, end) of their values."""
    out: dict[str, tuple[int, int]] = {}
    i = _ws(s, 0)
    i += 1  # "{"
    while True:
        i = _ws(s, i)
        if s[i] == "}":
            return out
        if s[i] == ",":
            i += 1
            continue
        k_end = _string_end(s, i)
        key = json.loads(s[i:k_end])
        i = _ws(s, k_end) + 1  # ":"
        v = _ws(s, i)
        v_end = _value_end(s, v)
        out[key] = (v, v_end)
        i = v_end


def _elements(s: str, start: int) -> list[tuple[int, int]]:
    """(start, end) of each element of the array whose ``[`` is at ``start``."""
    out: list[tuple[int, int]] = []
    i = start + 1
    while True:
        i = _ws(s, i)
        if s[i] == "]":
            return out
        if s[i] == ",":
            i += 1
            continue
        end = _value_end(s, i)
        out.append((i, end))
        i = end


# --- file helpers ------------------------------------------------------------------------------


def active_conf(conf_dir: str) -> str | None:
    """The network config file a runtime would load from ``conf_dir`` (first by name), or None."""
    try:
        names = sorted(n for n in os.listdir(conf_dir) if n.endswith(CONF_EXTS) and not n.startswith("."))
    except FileNotFoundError:
        return None
    return os.path.join(conf_dir, names[0]) if names else None


def atomic_write(path: str, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    """Write ``path`` through a temp file in its directory and a rename."""
    d, name = os.path.split(path)
    tmp = os.path.join(d or ".", f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
            if owner is not None:
                os.fchown(fd, *owner)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _read(path: str) -> tuple[bytes, os.stat_result]:
    with open(path, "rb") as f:
        data = f.read()
        return data, os.fstat(f.fileno())


def _is_ours(plugin: object) -> bool:
    return isinstance(plugin, dict) and plugin.get("type") == PLUGIN_TYPE


def _load(path: str, data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise InstallError(f"{path}: not valid JSON (nested too deeply); not touching it") from None
    except ValueError as e:  # not UTF-8, not JSON, an integer too long to convert
        raise InstallError(f"{path}: not valid JSON ({brief_text(str(e))}); not touching it") from None
    if not isinstance(doc, dict):
        raise InstallError(f"{path}: not a JSON object; not touching it")
    return doc


# --- install / uninstall -----------------------------------------------------------------------


def plugin_entry(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Our conflist entry as it is in force: every setting spelled out (``netconf.DEFAULTS``; the
    agent socket the thin plugin in the bin dir uses; the capabilities), ``overrides`` applied
    (``type`` is always ours), checked as the plugin checks it. ``InstallError`` names a bad setting."""
    from ..ambient.agent.protocol import DEFAULT_EVENTS_SOCKET

    entry = {"type": PLUGIN_TYPE, **copy.deepcopy(DEFAULTS), "agentSocket": DEFAULT_EVENTS_SOCKET,
             "capabilities": dict(CAPABILITIES)}
    entry.update(overrides or {})
    entry["type"] = PLUGIN_TYPE
    try:
        pc = PluginConf({"cniVersion": LATEST, **entry})
        cfg = pc.base_config()
    except CniError as e:
        raise InstallError(f"the redirect-cni entry: {e.msg}{': ' + e.details if e.details else ''}") from None
    # What every ADD would refuse: a backend name no backend has, an option the backend cannot lower.
    from ..backends import BACKENDS, refuse
    from ..errors import BackendUnavailable
    from ..plan.intent import intent_for

    if pc.backend not in BACKENDS:
        raise InstallError(f"the redirect-cni entry: backend={pc.backend!r}: unknown backend; choose one of "
                           f"{', '.join(BACKENDS)}")
    if pc.backend != "auto":
        try:
            refuse(intent_for(cfg), pc.backend)
        except BackendUnavailable as e:
            raise InstallError(f"the redirect-cni entry: {e}") from None
    return entry


def _add_to_conflist(path: str, text: str, doc: dict[str, Any], entry: dict[str, Any]) -> str | None:
    """The new text of a conflist with ``entry`` in it, or None if it is already there as is."""
    plugins = doc.get("plugins")
    if not isinstance(plugins, list):
        raise InstallError(f"{path}: has no \"plugins\" list; not touching it")
    span = _members(text)["plugins"]
    elems = _elements(text, span[0])
    ours = [i for i, p in enumerate(plugins) if _is_ours(p)]
    if ours and MARK_KEY in plugins[ours[0]]:
        entry = {**entry, MARK_KEY: plugins[ours[0]][MARK_KEY]}  # keep what uninstall needs
    rendered = json.dumps(entry)
    if ours:
        k = ours[0]
        if len(ours) == 1 and plugins[k] == entry:
            return None
        # Replace the first of ours, drop any duplicates (from the back, so spans stay valid).
        for j in reversed(ours[1:]):
            text = _remove_element(text, _elements(text, span[0]), j)
        a, b = _elements(text, span[0])[k]
        return text[:a] + rendered + text[b:]
    if not elems:
        return text[: span[0] + 1] + rendered + text[span[0] + 1 :]
    if len(elems) >= 2:
        sep = text[elems[-2][1] : elems[-1][0]]
    else:
        sep = "," + text[span[0] + 1 : elems[0][0]]
    end = elems[-1][1]
    return text[:end] + sep + rendered + text[end:]


def _remove_element(text: str, elems: list[tuple[int, int]], k: int) -> str:
    if k > 0:
        return text[: elems[k - 1][1]] + text[elems[k][1] :]
    if len(elems) > 1:
        return text[: elems[0][0]] + text[elems[1][0] :]
    return text[: elems[0][0]] + text[elems[0][1] :]


def _launcher(python: str) -> bytes:
    return (
        f"#!{python} -I\n"
        f"{LAUNCHER_MARK} (written by `redirect-cni install`, removed by `redirect-cni uninstall`)\n"
        "import sys\n"
        "from redirect.cni.plugin import main\n"
        "sys.exit(main())\n"
    ).encode()


def thin_binary() -> bytes:
    """The thin plugin's bytes, as the package build made it."""
    try:
        data = _read(THIN_BINARY)[0]
    except FileNotFoundError:
        raise InstallError(f"{THIN_BINARY}: the thin CNI plugin is missing; the package build makes it: reinstall"
                           " redirect with pip (its wheel or source tree; the build needs gcc), or run"
                           " `make bootstrap` in the source tree") from None
    if THIN_MARK not in data:
        raise InstallError(f"{THIN_BINARY}: not the thin CNI plugin (no install mark in it)")
    return data


def install_binary(bin_dir: str, python: str | None = None) -> list[str]:
    """Write ``<bin_dir>/redirect-cni`` (the thin plugin) and ``<bin_dir>/redirect-cni-python``
    (the Python plugin's launcher) where missing or different; the paths written."""
    os.makedirs(bin_dir, exist_ok=True)
    written = []
    for name, data in ((PLUGIN_TYPE, thin_binary()), (PYTHON_PLUGIN, _launcher(python or sys.executable))):
        path = os.path.join(bin_dir, name)
        try:
            if _read(path)[0] == data:
                continue
        except FileNotFoundError:
            pass
        atomic_write(path, data, 0o755)
        written.append(path)
    return written


def install(
    conf_dir: str = DEFAULT_CONF_DIR,
    bin_dir: str | None = DEFAULT_BIN_DIR,
    entry: Mapping[str, Any] | None = None,
    conf_file: str | None = None,
    standalone: str | None = None,
    primary: list[dict[str, Any]] | None = None,
    python: str | None = None,
) -> str | None:
    """Add our entry; returns the path written, or None if nothing needed changing."""
    ours = plugin_entry(entry)
    if bin_dir:
        install_binary(bin_dir, python)
    if standalone:
        if not standalone.endswith(".conflist") or "/" in standalone:
            raise InstallError(f"--standalone={standalone!r}: expected a file name ending in .conflist")
        os.makedirs(conf_dir, exist_ok=True)
        own = os.path.join(conf_dir, standalone)
        mark = dict(ours)
        mark[MARK_KEY] = {"standalone": True}
        doc = {"cniVersion": "1.0.0", "name": "redirect", "plugins": [*(primary or []), mark]}
        data = (json.dumps(doc, indent=2) + "\n").encode()
        try:
            if _read(own)[0] == data:
                return None
        except FileNotFoundError:
            pass
        atomic_write(own, data)
        return own
    path = os.path.join(conf_dir, conf_file) if conf_file else active_conf(conf_dir)
    if path is None:
        raise InstallError(f"{conf_dir}: no network config (*.conf, *.conflist, *.json) to add to;"
                           " install the primary CNI first, or use --standalone")
    try:
        data, st = _read(path)
    except FileNotFoundError:
        raise InstallError(f"{path}: does not exist") from None
    doc = _load(path, data)
    owner = (st.st_uid, st.st_gid)
    mode = st.st_mode & 0o7777
    if "plugins" in doc:
        new = _add_to_conflist(path, data.decode("utf-8"), doc, ours)
        if new is None:
            return None
        atomic_write(path, new.encode("utf-8"), mode, owner)
        return path
    if "type" not in doc:
        raise InstallError(f"{path}: neither a conflist (\"plugins\") nor a plugin config (\"type\")")
    if _is_ours(doc):
        raise InstallError(f"{path}: is a config of redirect-cni alone; it must be chained after a primary plugin")
    mark = dict(ours)
    mark[MARK_KEY] = {"convertedFrom": os.path.basename(path), "original": base64.b64encode(data).decode()}
    conflist = {"cniVersion": doc.get("cniVersion", "1.0.0"), "name": doc.get("name", ""), "plugins": [doc, mark]}
    target = os.path.splitext(path)[0] + ".conflist"
    if target != path and os.path.lexists(target):  # another tool's: never replaced
        raise InstallError(f"{path}: converting it to a conflist would replace {target}, which exists; not touching "
                           "either (name the file to add to with --conf-file, or remove one of them)")
    atomic_write(target, (json.dumps(conflist, indent=2) + "\n").encode(), mode, owner)
    if target != path:
        os.unlink(path)
    return target


class _Skip(Exception):
    """A conf-dir file ``uninstall`` cannot take our entry out of (it says why and goes on)."""


def _uninstall_file(conf_dir: str, path: str) -> str | None:
    """Take our entry out of the config at ``path``: the path written (the restored original of a
    converted ``.conf``), or None when it holds none. ``_Skip`` when it can't be done safely; then
    nothing is written."""
    try:
        data, st = _read(path)
        doc = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # not ours to judge
    except (RecursionError, ValueError) as e:  # nested too deeply, an integer too long
        raise _Skip(f"not JSON that can be read ({brief_text(str(e)) or type(e).__name__})") from None
    plugins = doc.get("plugins") if isinstance(doc, dict) else None
    if not isinstance(plugins, list) or not any(_is_ours(p) for p in plugins):
        return None
    mine = [p for p in plugins if _is_ours(p)]
    marks = [p.get(MARK_KEY) for p in mine if isinstance(p.get(MARK_KEY), dict)]
    if any(m.get("standalone") for m in marks):
        os.unlink(path)
        return path
    text = data.decode("utf-8")
    start = _members(text)["plugins"][0]
    for k in reversed([i for i, p in enumerate(plugins) if _is_ours(p)]):
        text = _remove_element(text, _elements(text, start), k)
    mode, owner = st.st_mode & 0o7777, (st.st_uid, st.st_gid)
    converted = next((m for m in marks if "convertedFrom" in m and "original" in m), None)
    if converted is not None:
        import binascii

        name, encoded = converted["convertedFrom"], converted["original"]
        if not isinstance(name, str) or not isinstance(encoded, str):
            raise _Skip(f"{MARK_KEY}: convertedFrom or original is not a string")
        try:
            original = base64.b64decode(encoded, validate=True)
        except binascii.Error as e:
            raise _Skip(f"{MARK_KEY}.original is not base64 ({e})") from None
        rest = json.loads(text)
        try:
            orig_doc = json.loads(original)
        except (ValueError, RecursionError):
            orig_doc = None
        if rest.get("plugins") == [orig_doc]:
            back = os.path.join(conf_dir, os.path.basename(name))
            atomic_write(back, original, mode, owner)
            if back != path:
                os.unlink(path)
            return back
    atomic_write(path, text.encode("utf-8"), mode, owner)
    return path


def uninstall(conf_dir: str = DEFAULT_CONF_DIR, bin_dir: str | None = DEFAULT_BIN_DIR) -> list[str]:
    """Remove our entry from every config in ``conf_dir`` (and our launcher); the paths changed. A
    file it cannot take the entry out of safely (nested too deeply to read, a mangled
    ``redirectInstall`` mark) is left as it is, with a warning, and the others are done."""
    changed: list[str] = []
    try:
        names = sorted(n for n in os.listdir(conf_dir) if n.endswith(CONF_EXTS) and not n.startswith("."))
    except FileNotFoundError:
        names = []
    for name in names:
        path = os.path.join(conf_dir, name)
        try:
            written = _uninstall_file(conf_dir, path)
        except _Skip as e:
            logging.getLogger("redirect.cni.install").warning("uninstall: %s: %s; left as it is", path, e)
            continue
        if written is not None:
            changed.append(written)
    if bin_dir:
        for name, mark in ((PLUGIN_TYPE, THIN_MARK), (PLUGIN_TYPE, LAUNCHER_MARK.encode()),
                           (PYTHON_PLUGIN, LAUNCHER_MARK.encode())):
            path = os.path.join(bin_dir, name)
            try:
                if mark in _read(path)[0]:
                    os.unlink(path)
            except FileNotFoundError:
                pass
    return changed


def watch(
    stop: threading.Event,
    conf_dir: str = DEFAULT_CONF_DIR,
    bin_dir: str | None = DEFAULT_BIN_DIR,
    entry: Mapping[str, Any] | None = None,
    conf_file: str | None = None,
    interval: float = 1.0,
    max_seconds: float | None = None,
    on_install: Any = None,
    standalone: str | None = None,
    primary: list[dict[str, Any]] | None = None,
    python: str | None = None,
) -> int:
    """Keep our entry and executables installed until ``stop`` is set (or ``max_seconds``): the
    entry is re-added when the config is rewritten, a binary when it is removed or replaced.
    Returns how many files were (re-)written; ``on_install`` gets each path. ``standalone``,
    ``primary`` and ``python`` are ``install``'s."""
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    count = 0
    while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
        paths: list[str] = []
        try:
            if bin_dir:
                paths += install_binary(bin_dir, python)
            path = install(conf_dir, None, entry, conf_file, standalone, primary)
            if path is not None:
                paths.append(path)
        except (InstallError, OSError) as e:  # no primary config yet: wait for it
            logging.getLogger("redirect.cni.install").warning("install --watch: %s", e)
        for path in paths:
            count += 1
            if on_install is not None:
                on_install(path)
        wait = interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic()))
        stop.wait(wait)
    return count


# --- CLI -----------------------------------------------------------------------------------------


#: The longest ``--plugin-config`` / ``--primary`` file read.
MAX_JSON_ARG = 1 << 20


def _json_arg(text: str | None, what: str) -> Any:
    if text is None:
        return None
    if text.startswith("@"):
        path = text[1:]
        from ..config import read_regular_file

        try:
            raw = read_regular_file(path, MAX_JSON_ARG + 1)
        except OSError as e:
            raise InstallError(f"{what}: cannot read {path}: {e.strerror or e}") from None
        if len(raw) > MAX_JSON_ARG:
            raise InstallError(f"{what}: {path} is larger than {MAX_JSON_ARG} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InstallError(f"{what}: {path} is not UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise InstallError(f"{what}: not valid JSON (nested too deeply)") from None
    except ValueError as e:
        raise InstallError(f"{what}: not valid JSON ({brief_text(str(e))})") from None


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="redirect-cni", description="Install redirect-cni into a node's CNI config. "
                                "(Run by a container runtime with CNI_COMMAND set, it is the CNI plugin.)")
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("install", "uninstall"):
        s = sub.add_parser(name)
        s.add_argument("--conf-dir", default=DEFAULT_CONF_DIR, help="CNI config dir (default %(default)s)")
        s.add_argument("--bin-dir", default=DEFAULT_BIN_DIR, help="CNI plugin dir (default %(default)s)")
        if name == "install":
            s.add_argument("--conf-file", help="the config file to add to (default: the active one)")
            s.add_argument("--plugin-config", help="our entry's settings: JSON or @file")
            s.add_argument("--standalone", metavar="NAME", help="write a conflist of our own named NAME")
            s.add_argument("--primary", help="with --standalone: JSON list (or @file) of plugins before ours")
            s.add_argument("--python", help="interpreter for the launcher (default: this one)")
            s.add_argument("--watch", action="store_true",
                           help="keep our entry and executables installed (re-add them) until stopped")
            s.add_argument("--interval", type=seconds_arg(0.01, 3600), default=1.0,
                           help="--watch poll interval, seconds")
            s.add_argument("--max-seconds", type=seconds_arg(0, 31_536_000), help="--watch stops after this long")
        s.add_argument("--log-json", action="store_true",
                       help="report as JSON lines on stderr (time, level, logger, msg), not text")
    a = p.parse_args(argv)
    from .. import logjson

    logjson.setup(json_lines=a.log_json, level=logging.INFO, text_format="redirect-cni: %(message)s")
    log = logging.getLogger("redirect.cni.install")

    def say(text: str) -> None:  # what the installer did: stdout as text, or a JSON log line
        if a.log_json:
            log.info(text)
        else:
            print(text, flush=True)

    try:
        if a.cmd == "uninstall":
            for path in uninstall(a.conf_dir, a.bin_dir):
                say(f"removed redirect-cni from {path}")
            return 0
        entry = _json_arg(a.plugin_config, "--plugin-config")
        if entry is not None and not isinstance(entry, dict):
            raise InstallError("--plugin-config: expected a JSON object")
        primary = _json_arg(a.primary, "--primary")
        plugin_entry(entry)  # a bad setting fails here, before anything is written (--watch too)
        if a.watch:
            stop = threading.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            watch(stop, a.conf_dir, a.bin_dir, entry, a.conf_file, a.interval, a.max_seconds,
                  on_install=lambda path: say(f"installed redirect-cni into {path}"), standalone=a.standalone,
                  primary=primary, python=a.python)
            return 0
        written = install(a.conf_dir, a.bin_dir, entry, a.conf_file, a.standalone, primary, a.python)
        say(f"installed redirect-cni into {written}" if written else "redirect-cni already installed")
        return 0
    except (InstallError, OSError) as e:
        log.error("%s", e)
        return 1
