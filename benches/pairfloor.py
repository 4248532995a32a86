"""The data path's ``pairing-floor`` case: plain loopback TCP with the least sockmap pairing the
kernel allows (``fastpath/pairfloor.bpf.c``), no capture.

It answers what any app <-> proxy pairing must pay at connect, whoever writes it: both ends of a
connection joined to a sockhash when established (a psock each, their protocol operations
switched, freed after an RCU grace period at close) and each send moved to the peer's receive
queue. Its connection rate against ``direct`` is the kernel's own floor for pairing; with eBPF
capture's rate against ``direct`` it bounds what ``sockmap=True`` can reach (``report.py``).

The programs are compiled with bcc against the header tree the package carries, loaded in this
process and attached with ``bpf_link``s (the sockhash's ``sk_msg`` for the object's life, the
cgroup's ``sock_ops`` only for each of the case's own runs: ``attached``, so the other cases'
connections never run it): closing the links detaches them, and a process that dies closes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Any

from redirect.backends.ebpf.abi import const
from redirect.backends.ebpf.host.objects import HEADERS_DIR
from redirect.backends.ebpf.host.pins import resolve_cgroup
from redirect.backends.ebpf.host.syscalls import link_create
from redirect.kernel import netns as rnetns

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastpath", "pairfloor.bpf.c")
#: ``counts``' slots (see the source)
COUNTS = ("joined", "redirected", "no_peer")


class PairFloor:
    """The floor programs, for TCP connections to ``port`` in netns ``pod``: the ``sk_msg`` one on
    its sockhash until ``close``, the ``sock_ops`` one on the cgroup within ``attached``."""

    def __init__(self, pod: str, port: int) -> None:
        with rnetns.enter(pod):
            cookie = rnetns.current_cookie()
        os.environ["BCC_KERNEL_SOURCE"] = HEADERS_DIR  # (as the host programs' loader does)
        from bcc import BPF, libbcc

        self._bpf: Any = BPF(src_file=SOURCE.encode(), cflags=[f"-DNETNS={cookie}ULL", f"-DPORT={port}"])
        self._links: list[int] = []
        self._cgroup = -1
        try:
            self._ops = self._bpf.load_func(b"floor_ops", BPF.SOCK_OPS)
            msg = self._bpf.load_func(b"floor_msg", BPF.SK_MSG)
            ends = int(libbcc.lib.bpf_table_fd(self._bpf.module, b"ends"))  # (bcc has no Table for sockhash)
            self._links.append(link_create(msg.fd, ends, const("BPF_SK_MSG_VERDICT")))
            self._cgroup = os.open(resolve_cgroup(None), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        """The ``sock_ops`` program on the cgroup for the body (one of the case's runs) only."""
        link = link_create(self._ops.fd, self._cgroup, const("BPF_CGROUP_SOCK_OPS"))
        try:
            yield
        finally:
            os.close(link)

    def counts(self) -> dict[str, int]:
        """What the programs did so far: ends joined, sends redirected, sends that found no peer."""
        table = self._bpf[b"counts"]
        return {name: int(sum(table[ctypes.c_int(i)])) for i, name in enumerate(COUNTS)}

    def close(self) -> None:
        """Detach (the links first), and let the programs go."""
        for fd in reversed(self._links):
            os.close(fd)
        self._links.clear()
        if self._cgroup >= 0:
            os.close(self._cgroup)
            self._cgroup = -1
        self._bpf.cleanup()
