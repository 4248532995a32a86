"""The host programs' compile and load, in a short-lived process of their own.

``python -m redirect.backends.ebpf.host.loader --root R --cgroup C`` compiles ``redirect/bpf/`` through
bcc against the header tree the package carries (``redirect/bpf/headers/``, given to bcc as
``BCC_KERNEL_SOURCE``: the kernel's UAPI and a few headers of ours, so no node needs kernel
headers), loads the programs, pins them and their maps under ``R``, loads the pool's first batch,
attaches the cgroup programs to ``C`` with pinned links, and exits. bcc and LLVM are mapped in
that process only: ``HostPrograms.open_or_load`` runs it (``launch.run_loader``) under the host
lock, whose fd the child inherits (so the lock is held until both are gone), then opens the
pins; every long-lived process (the agent, a user's process calling ``redirect.setup``) uses
bpf(2) through the native module only. It runs once per host (per pin root and build of
``redirect/bpf/``), never per pod.

On failure the child unpins whatever it pinned, and answers on ``--result-fd`` with the error's
class and message, which ``launch.run_loader`` raises again in the caller; a child that dies without
an answer (killed, or over ``launch.LOAD_TIMEOUT``) has its pins removed by its caller.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

from ....errors import BackendUnavailable, SetupError
from ..abi import U32
from .objects import (
    BPF_DIR,
    CGROUP_PROGRAMS,
    HEADERS_DIR,
    MAP_ATTACHED,
    MAPS,
    PROGRAMS,
    SOURCES,
    build_id,
    build_pin,
)
from .pins import check_dirs, make_dirs, probe_kernel, require_cgroup, unpin_all
from .pool import fill
from .programs import attach_to_cgroup
from .syscalls import NATIVE, check, obj_pin


def compile_load_pin(root: str, cgroup: str) -> int:
    """Compile, load, pin and attach the host programs under ``root`` (in this process: bcc is
    imported here); where the pool's next batch starts. Unpins everything on failure."""
    probe_kernel()
    require_cgroup(cgroup)
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
        check_dirs(root)  # (before anything under it is removed)
        unpin_all(root)
        make_dirs(root)

        def table(name: str) -> int:
            # By fd, not b[name]: bcc's Table class has no type for sockhash.
            fd = int(libbcc.lib.bpf_table_fd(b.module, name.encode()))
            if fd < 0:
                raise BackendUnavailable(f"ebpf: map {name} missing from the compiled object")
            return fd

        for m in MAPS:
            obj_pin(table(m), os.path.join(root, "maps", m))
        obj_pin(table("build_id"), os.path.join(root, "maps", build_pin(build_id())))
        for name, fn in fns.items():
            obj_pin(fn.fd, os.path.join(root, "progs", name))
        # The pods' sk_lookup programs tail-call this one (redirect/bpf/redirect.h, lookup_prog).
        check(NATIVE.lib.rdr_bpf_map_update(table("lookup_prog"), U32.pack(0), U32.pack(fns["rdr_sk_lookup"].fd),
                                            0), "update lookup_prog")
        # sk_msg programs go on their map (the map holds them: a paired socket keeps both).
        for name, mname in MAP_ATTACHED.items():
            if libbcc.lib.bpf_prog_attach(fns[name].fd, table(mname), PROGRAMS[name][1], 0) < 0:
                raise BackendUnavailable(f"ebpf: attaching {name} to map {mname} failed")
        # The first batch of the pods' own sk_lookup programs (``.pool``; none kept open here).
        maps = NATIVE.ffi.new("struct rdr_host_maps *")
        maps.slots, maps.lookup_netns, maps.lookup_prog, maps.pool, maps.free = (
            table(n) for n in ("lookup_slots", "lookup_netns", "lookup_prog", "lookup_pool", "lookup_free"))
        hint = fill(maps, 0)
        attach_to_cgroup(root, cgroup, {name: fns[name].fd for name in CGROUP_PROGRAMS})
    except BaseException:
        unpin_all(root)
        raise
    finally:
        b.cleanup()
    return hint


class _CompileError(BackendUnavailable):
    """bcc could not compile the programs (its diagnostics are on stderr)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m redirect.backends.ebpf.host.loader",
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
