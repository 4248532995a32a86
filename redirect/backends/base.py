"""What every backend provides, and the results it returns."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..errors import BackendUnavailable
from ..plan.intent import AnyIntent, refusals

_T = TypeVar("_T")

#: Every rule of ours carries a comment starting with this (``redirect`` or ``redirect: <purpose>``):
#: with our exact object names (``POD_CHAINS`` under each backend's prefix), what tells ours
#: from someone else's object of the same name.
MARK = "redirect"

#: The plan's chain names (sidecar and ambient): a pod's chains are exactly these (with the
#: backend's prefix or table); any other name is not the pod's.
POD_CHAINS = frozenset({"PREROUTING", "OUTPUT", "INBOUND", "OUTBOUND", "REDIRECT", "IN_REDIRECT", "DIVERT",
                        "TPROXY", "DROP", "DNS", "DNS_IN"})


#: The eBPF backend's pin root unless ``REDIRECT_BPF_ROOT`` names another (here, not in the eBPF
#: package: ``redirect.api`` and the CLI look for pins there without loading the backend).
EBPF_DEFAULT_ROOT = "/sys/fs/bpf/redirect"


def kind_of(backend_name: str) -> str:
    """The kind of capture a backend installs: ``iptables`` (either variant), ``nftables``, ``ebpf``."""
    return "iptables" if backend_name.startswith("iptables") else backend_name


def refuse(it: AnyIntent, name: str) -> None:
    """``BackendUnavailable`` naming the first option of ``it`` backend ``name`` cannot lower
    (``redirect.plan.intent.refusals``), and why; nothing is installed."""
    kind = kind_of(name)
    for r in refusals(it, kind):  # type: ignore[arg-type]
        other = "iptables" if kind == "ebpf" else "ebpf"
        shown = "eBPF" if kind == "ebpf" else kind
        raise BackendUnavailable(f"backend={name}: {r.option} is not available with {shown} ({r.why});"
                                 f" use backend={other}")


def ebpf_root() -> str:
    """The eBPF backend's pin root now (``REDIRECT_BPF_ROOT``, else the default)."""
    return os.environ.get("REDIRECT_BPF_ROOT") or EBPF_DEFAULT_ROOT


def list_differences(where: str, what: str, cur: Sequence[_T], want: Sequence[_T],
                     text: Callable[[_T], str] = str) -> list[str]:
    """``check``'s differences between two lists: ``<where>: missing <what>: <item>`` for each
    wanted item that is not installed, then ``unexpected`` for each installed one not wanted."""
    return ([f"{where}: missing {what}: {text(x)}" for x in want if x not in cur]
            + [f"{where}: unexpected {what}: {text(x)}" for x in cur if x not in want])


def owned_comment(purpose: str) -> str:
    """The comment of one rule of ours: our mark, then why the rule exists."""
    return f"{MARK}: {purpose}" if purpose else MARK


def is_owned_comment(comment: str) -> bool:
    return comment == MARK or comment.startswith(MARK + ": ")


@dataclass(frozen=True)
class Installed:
    """What ``setup`` did: which backend, which families, and whether anything changed."""

    backend: str
    netns: str
    families: tuple[int, ...]
    changed: bool
    #: Backend-specific detail (iptables variant, nft table names, BPF link ids...).
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckResult:
    """Whether what is installed equals what the config wants; ``differences`` says how not."""

    ok: bool
    backend: str
    differences: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok


class Backend(Protocol):
    """A backend turns an intent into kernel state in the netns the calling thread is in.

    It is given the intent (``redirect.plan.intent``), never the config: the netfilter backends
    render its netfilter plan (``redirect.plan.netfilter_plan``), the eBPF backend its eBPF
    lowering (``redirect.plan.lower_ebpf``); every backend installs the intent's policy routes and
    local addresses (``redirect.kernel.routes``)."""

    name: str

    def apply(self, it: AnyIntent, families: tuple[int, ...]) -> Installed: ...

    def remove(self, keep_routes: bool = False) -> bool: ...

    def check(self, it: AnyIntent, families: tuple[int, ...]) -> CheckResult: ...

    def show(self) -> dict[str, Any]: ...

    def render(self, it: AnyIntent, families: tuple[int, ...]) -> str: ...

    def installed(self) -> bool: ...


def fault_point(name: str) -> None:
    """Fault injection for the atomicity tests: ``REDIRECT_FAULT=<name>`` makes this point raise.

    Points: ``iptables.before_restore_v6``, ``iptables.before_restore_v4`` (IPv6 goes first),
    ``iptables.remove_v4``, ``iptables.remove_v6``, ``iptables.before_routes_finish``,
    ``nftables.before_transaction``, ``nftables.after_transaction``, ``ebpf.before_fwmark_accept``
    (after the policy; the eBPF backend's other points are in its native writer,
    ``native/pod_setup.c``, which reads the same variable). ``<name>:kill`` SIGKILLs
    the process there instead, as a crash would (the kill tests: nothing runs after it, not
    even a rollback).
    """
    fault = os.environ.get("REDIRECT_FAULT")
    if fault is None:
        return
    if fault == name:
        from ..errors import SetupError

        raise SetupError(f"injected fault at {name}")
    if fault == name + ":kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
