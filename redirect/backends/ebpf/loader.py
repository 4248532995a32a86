"""The host programs' compile and load, in a short-lived process of their own.

``python -m redirect.backends.ebpf.loader --root R --cgroup C`` compiles ``redirect/bpf/`` through
bcc against the header tree the package carries (``redirect/bpf/headers/``, given to bcc as
``BCC_KERNEL_SOURCE``: the kernel's UAPI and a few headers of ours, so no node needs kernel
headers), loads the programs, pins them and their maps under ``R``, loads the pool's first batch,
attaches the cgroup programs to ``C`` with pinned links, and exits. bcc and LLVM are mapped in that
process only: ``HostPrograms.open_or_load`` runs it (``load``) under the host lock, whose fd the
child inherits (so the lock is held until both are gone), then opens the pins; every long-lived
process (the agent, a user's process calling ``redirect.setup``) uses bpf(2) through the native
module only. It runs once per host (per pin root and build of ``redirect/bpf/``), never per pod.

On failure the child unpins whatever it pinned, and answers on ``--result-fd`` with the error's
class and message, which ``load`` raises again in the caller; a child that dies without an answer
(killed, or over ``LOAD_TIMEOUT``) has its pins removed by ``load``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

from ...errors import BackendUnavailable, SetupError
from .abi import MAPS, PROGRAMS, U32
from .host import (
    BPF_DIR,
    HEADERS_DIR,
    SOURCES,
    _attach_to_cgroup,
    _build_pin,
    _cgroup_progs,
    _require_cgroup,
    _unpin_all,
    probe_kernel,
)
from .pool import fill
from .syscalls import _check, _native, obj_pin

#: Seconds the loader may take (it compiles in about a second) before it is killed.
LOAD_TIMEOUT = 120.0
#: The error classes the loader's answer may name; anything else is reported as a ``SetupError``.
_ERRORS: dict[str, type[Exception]] = {"BackendUnavailable": BackendUnavailable, "compile": BackendUnavailable,
                                       "SetupError": SetupError}
#: At most this much of the loader's stderr (bcc's compiler diagnostics) goes into an error.
_STDERR_TAIL = 4000


def load(root: str, cgroup: str, lock_fd: int, timeout: float = LOAD_TIMEOUT) -> int:
    """Run the loader for ``root``/``cgroup`` and wait for it (the caller holds the host lock on
    ``lock_fd``); where the pool's next batch starts. Raises what the loader raised."""
    r, w = os.pipe2(os.O_CLOEXEC)
    cmd = [sys.executable, "-m", __name__, "--root", root, "--cgroup", cgroup, "--result-fd", str(w)]
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
            _unpin_all(root)
            raise BackendUnavailable(f"ebpf: the host programs' loader ({_shown(cmd)}) took more than {timeout:.0f} s"
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
    _unpin_all(root)
    raise BackendUnavailable(f"ebpf: the host programs' loader ({_shown(cmd)}) exited with {p.returncode} without"
                             f" an answer; nothing is left pinned under {root}" + (f":\n{detail}" if detail else ""))


def _child_env() -> dict[str, str]:
    """The caller's environment, with this package first on the loader's ``sys.path`` (so it runs
    this very code) and bcc's arch taken from the machine (``ARCH`` would override it)."""
    env = dict(os.environ)
    env.pop("ARCH", None)
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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


# --- the loader process ---------------------------------------------------------------------


def compile_load_pin(root: str, cgroup: str) -> int:
    """Compile, load, pin and attach the host programs under ``root`` (in this process: bcc is
    imported here); where the pool's next batch starts. Unpins everything on failure."""
    probe_kernel()
    _require_cgroup(cgroup)
    # bcc's loader compiles against $BCC_KERNEL_SOURCE when set (else the node's kernel headers).
    os.environ["BCC_KERNEL_SOURCE"] = HEADERS_DIR
    from bcc import BPF, libbcc

    text = "".join(open(os.path.join(BPF_DIR, n), encoding="utf-8").read() for n in SOURCES)
    text += "\n/* which sources these pins came from (see build_id) */\nBPF_ARRAY(build_id, __u32, 1);\n"
    try:
        b = BPF(text=text.encode(), cflags=[f"-I{BPF_DIR}", "-Wno-unused-function"])
    except Exception as e:
        raise _CompileError(f"ebpf: compiling redirect/bpf/ with bcc (headers: {HEADERS_DIR}) failed: {e}") from None
    fns: dict[str, Any] = {}
    try:
        for name, (ptype, atype, _cg) in PROGRAMS.items():
            try:
                fns[name] = b.load_func(name.encode(), ptype, attach_type=atype)
            except Exception as e:
                raise BackendUnavailable(f"ebpf: the kernel refused program {name}: {e}") from None
        # Clear leftovers of a half-done earlier load (ours only: this root).
        _unpin_all(root)
        for d in ("maps", "progs", "links", "pods"):
            os.makedirs(os.path.join(root, d), exist_ok=True)

        def table(name: str) -> int:
            # By fd, not b[name]: bcc's Table class has no type for sockhash.
            fd = int(libbcc.lib.bpf_table_fd(b.module, name.encode()))
            if fd < 0:
                raise BackendUnavailable(f"ebpf: map {name} missing from the compiled object")
            return fd

        for m in MAPS:
            obj_pin(table(m), os.path.join(root, "maps", m))
        obj_pin(table("build_id"), os.path.join(root, "maps", _build_pin()))
        for name, fn in fns.items():
            obj_pin(fn.fd, os.path.join(root, "progs", name))
        # The pods' sk_lookup programs tail-call this one (redirect/bpf/redirect.h, lookup_prog).
        _check(_native().lib.rdr_bpf_map_update(table("lookup_prog"), U32.pack(0), U32.pack(fns["rdr_sk_lookup"].fd),
                                                0), "update lookup_prog")
        # The first batch of the pods' own sk_lookup programs (``.pool``).
        hint = fill(table("lookup_slots"), table("lookup_netns"), table("lookup_prog"), table("lookup_pool"),
                    table("lookup_free"), 0)
        _attach_to_cgroup(root, cgroup, {name: fns[name].fd for name in _cgroup_progs()})
    except BaseException:
        _unpin_all(root)
        raise
    finally:
        b.cleanup()
    return hint


class _CompileError(BackendUnavailable):
    """bcc could not compile the programs (its diagnostics are on stderr)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m redirect.backends.ebpf.loader",
        description="Compile redirect's eBPF host programs with bcc (against the UAPI headers the package carries), "
                    "load them, pin them under --root and attach the cgroup programs to --cgroup, then exit. "
                    "Run by the eBPF backend under its host lock when the pins are missing; not meant to be run "
                    "by hand while pods are registered under that root.")
    p.add_argument("--root", required=True, help="bpffs directory of the pins")
    p.add_argument("--cgroup", required=True, help="cgroup v2 directory the cgroup programs are attached to")
    p.add_argument("--result-fd", type=int, default=1, help="fd the JSON answer is written to (default: stdout)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        hint = compile_load_pin(a.root, a.cgroup)
        res: dict[str, Any] = {"ok": True, "hint": hint, "ms": round((time.perf_counter() - t0) * 1e3, 1)}
    except BaseException as e:  # noqa: BLE001 - every failure is answered, the caller raises it again
        kind = "compile" if isinstance(e, _CompileError) else type(e).__name__
        msg = str(e) if isinstance(e, (BackendUnavailable, SetupError)) else \
            f"ebpf: loading the host programs under {a.root} failed: {type(e).__name__}: {e}"
        res = {"ok": False, "kind": kind, "error": msg[:8000]}
    data = (json.dumps(res) + "\n").encode()
    with contextlib.suppress(OSError):
        view = memoryview(data)
        while view:
            view = view[os.write(a.result_fd, view):]
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
