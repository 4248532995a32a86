"""Starting the loader process (``.loader``) and reading its answer, for ``HostPrograms.open_or_load``.

The loader runs as ``python -m redirect.backends.ebpf.host.loader`` with this package first on its
``sys.path``, the caller's host lock fd inherited (the lock stays held until both are gone), and
a pipe for its answer: one JSON object, ``{"ok": true, "hint": N}`` or the error's kind and
message, which ``run_loader`` raises again here. Nothing of bcc is imported in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ....errors import BackendUnavailable, SetupError


class LoaderDied(BackendUnavailable):
    """The loader gave no answer (killed, or over its time): it may have left pins behind."""


#: The loader process's module (``python -m``): it compiles, loads, pins and attaches, then exits.
LOADER = __package__ + ".loader"
#: Seconds the loader may take before it is killed.
LOAD_TIMEOUT = 120.0
#: The error classes the loader's answer may name; anything else is reported as a ``SetupError``.
_ERRORS: dict[str, type[Exception]] = {"BackendUnavailable": BackendUnavailable, "compile": BackendUnavailable,
                                       "SetupError": SetupError}
#: At most this much of the loader's stderr (bcc's compiler diagnostics) goes into an error.
_STDERR_TAIL = 4000


def run_loader(root: str, cgroup: str, lock_fd: int, timeout: float = LOAD_TIMEOUT) -> int:
    """Run the loader process (``.loader``) for ``root``/``cgroup`` and wait for it (the caller holds
    the host lock on ``lock_fd``, which the loader inherits); where the pool's next batch starts.
    Raises what the loader raised (its class and message, bcc's diagnostics after a compile error);
    ``LoaderDied`` if it answered nothing (killed, over ``timeout``): the caller removes its pins."""
    r, w = os.pipe2(os.O_CLOEXEC)
    cmd = [sys.executable, "-m", LOADER, "--root", root, "--cgroup", cgroup, "--result-fd", str(w)]
    try:
        try:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 pass_fds=(w, lock_fd), env=_child_env())
        finally:
            os.close(w)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise LoaderDied(f"ebpf: the host programs' loader ({_shown(cmd)}) took more than {timeout:.0f} s"
                                     f" and was killed; nothing is left pinned under {root}") from None
        answer = _read_all(r)
    finally:
        os.close(r)
    try:
        res = json.loads(answer) if answer else None
    except ValueError:
        res = None
    detail = _tail(err.decode(errors="replace") + out.decode(errors="replace"))
    if isinstance(res, dict) and res.get("ok") is True and isinstance(res.get("hint"), int):
        return int(res["hint"])
    if isinstance(res, dict) and isinstance(res.get("error"), str):
        cls = _ERRORS.get(str(res.get("kind")), SetupError)
        raise cls(res["error"] + (f"\n{detail}" if detail and res.get("kind") == "compile" else ""))
    raise LoaderDied(f"ebpf: the host programs' loader ({_shown(cmd)}) exited with {p.returncode} without"
                             f" an answer; nothing is left pinned under {root}" + (f":\n{detail}" if detail else ""))


def _child_env() -> dict[str, str]:
    """The caller's environment, with this package first on the loader's ``sys.path`` (so it runs
    this very code) and bcc's arch taken from the machine (``ARCH`` would override it)."""
    env = dict(os.environ)
    env.pop("ARCH", None)
    top = os.path.abspath(__file__)
    for _ in range(len(__package__.split(".")) + 1):  # (redirect/backends/ebpf/host/launch.py: the tree above)
        top = os.path.dirname(top)
    env["PYTHONPATH"] = os.pathsep.join([top, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def _read_all(fd: int) -> bytes:
    data = b""
    while len(data) < 1 << 20:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _STDERR_TAIL else "..." + text[-_STDERR_TAIL:]


def _shown(cmd: list[str]) -> str:
    return " ".join(a for a in cmd[:3]) + " ..."
