"""The iptables backend: one ``iptables-restore --noflush`` payload per family.

Only our chains (``RDR_*``) and one unconditional jump per hook into them are ever
written; every other rule is left as it is. Rules are rendered in exactly the form
``iptables-save`` prints them, so what is installed can be read back and compared
line by line (``check``), and a setup whose rules are already in place changes
nothing.

A config change rewrites our chains inside one restore per family (atomic per
table: the kernel swaps each table's rules at once). Across families and routes,
atomicity comes from rollback: if the IPv6 payload fails after IPv4 applied, the
IPv4 rules and routes are put back as they were.

The variant (legacy xtables or nf_tables) is chosen per namespace: whichever one
already holds rules there wins; with neither, the host's ``iptables`` alternative.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import routes as rt
from ..config import IdSpec, RedirectConfig
from ..errors import BackendUnavailable, SetupError
from ..plan import (
    Accept,
    Action,
    Addr,
    ConnMark,
    CtState,
    CtZone,
    Drop,
    Iface,
    Jump,
    Mark,
    Owner,
    Plan,
    Port,
    Proto,
    Redirect,
    RestoreMark,
    Return,
    Rule,
    SaveMark,
    SetConnMark,
    SetMark,
    Socket,
    TProxy,
)
from .base import CheckResult, Installed, fault_point

log = logging.getLogger("redirect.iptables")

PREFIX = "RDR_"
BUILTIN = {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}
HOOK_CHAIN = {"prerouting": "PREROUTING", "output": "OUTPUT"}
TABLE_ORDER = ("raw", "mangle", "nat")
VARIANTS = ("legacy", "nft")
FULL = 0xFFFFFFFF


# --- rendering -----------------------------------------------------------------------


def _mark(value: int, mask: int) -> str:
    return f"{value:#x}" if mask == FULL else f"{value:#x}/{mask:#x}"


def _idspec(i: IdSpec) -> str:
    return f"{i[0]}-{i[1]}" if isinstance(i, tuple) else str(i)


def _quote(text: str) -> str:
    # iptables-save escapes quotes and backslashes; the planner's comments have none.
    if any(c in text for c in "\"'\\"):
        raise ValueError(f"rule comment {text!r} must not contain quotes or backslashes")
    return f'"{text}"' if (" " in text or not text) else text


def render_rule(chain: str, rule: Rule, with_comment: bool = True) -> str:
    """One rule as ``iptables-save`` prints it (``-A CHAIN ...``)."""
    parts = ["-A", chain]
    m = rule.matches
    # iptables-save prints the fixed fields first, in this order, then modules in order.
    for side, flag in (("src", "-s"), ("dst", "-d")):
        for a in m:
            if isinstance(a, Addr) and a.side == side:
                parts += (["!"] if a.neg else []) + [flag, a.cidr]
    for side, flag in (("in", "-i"), ("out", "-o")):
        for i in m:
            if isinstance(i, Iface) and i.side == side:
                parts += (["!"] if i.neg else []) + [flag, i.name]
    proto = next((p.name for p in m if isinstance(p, Proto)), None)
    if proto:
        parts += ["-p", proto]
    ports = [p for p in m if isinstance(p, Port)]
    single = [p for p in ports if len(p.ports) == 1]
    if single:
        if proto is None:
            raise ValueError(f"port match without protocol in {rule}")
        parts += ["-m", proto]
        for p in single:
            parts += (["!"] if p.neg else []) + ["--sport" if p.side == "src" else "--dport", str(p.ports[0])]
    for x in m:
        if isinstance(x, Port) and len(x.ports) > 1:
            parts += ["-m", "multiport"] + (["!"] if x.neg else [])
            parts += ["--sports" if x.side == "src" else "--dports", ",".join(map(str, x.ports))]
        elif isinstance(x, Owner):
            parts += ["-m", "owner"] + (["!"] if x.neg else []) + [f"--{x.kind}-owner", _idspec(x.id)]
        elif isinstance(x, Mark):
            parts += ["-m", "mark"] + (["!"] if x.neg else []) + ["--mark", _mark(x.value, x.mask)]
        elif isinstance(x, ConnMark):
            parts += ["-m", "connmark"] + (["!"] if x.neg else []) + ["--mark", _mark(x.value, x.mask)]
        elif isinstance(x, CtState):
            parts += ["-m", "conntrack", "--ctstate", ",".join(x.states)]
        elif isinstance(x, Socket):
            parts += ["-m", "socket"]
            if x.transparent:
                parts.append("--transparent")
            if x.nowildcard:
                parts.append("--nowildcard")
    if with_comment and rule.comment:
        parts += ["-m", "comment", "--comment", _quote(rule.comment)]
    parts += _render_action(rule.action)
    return " ".join(parts)


def _render_action(a: Action) -> list[str]:
    if isinstance(a, Return):
        return ["-j", "RETURN"]
    if isinstance(a, Accept):
        return ["-j", "ACCEPT"]
    if isinstance(a, Drop):
        return ["-j", "DROP"]
    if isinstance(a, Jump):
        return ["-j", PREFIX + a.chain]
    if isinstance(a, Redirect):
        return ["-j", "REDIRECT", "--to-ports", str(a.port)]
    if isinstance(a, TProxy):
        return ["-j", "TPROXY", "--on-port", str(a.port), "--on-ip", "{ANY}", "--tproxy-mark",
                f"{a.mark:#x}/{a.mask:#x}"]
    if isinstance(a, SetMark):
        return ["-j", "MARK", "--set-xmark", f"{a.value:#x}/{a.mask:#x}"]
    if isinstance(a, SetConnMark):
        return ["-j", "CONNMARK", "--set-xmark", f"{a.value:#x}/{a.mask:#x}"]
    if isinstance(a, SaveMark):
        return ["-j", "CONNMARK", "--save-mark", "--nfmask", f"{a.mask:#x}", "--ctmask", f"{a.mask:#x}"]
    if isinstance(a, RestoreMark):
        return ["-j", "CONNMARK", "--restore-mark", "--nfmask", f"{a.mask:#x}", "--ctmask", f"{a.mask:#x}"]
    if isinstance(a, CtZone):
        return ["-j", "CT", "--zone", str(a.zone)]
    raise TypeError(f"unknown action {a!r}")


@dataclass
class TableState:
    """Our part of one table: chains (name -> rule lines) and jumps from built-in chains."""

    chains: dict[str, list[str]] = field(default_factory=dict)
    jumps: list[str] = field(default_factory=list)  # "-A OUTPUT -j RDR_OUTPUT"

    def empty(self) -> bool:
        return not self.chains and not self.jumps


State = dict[str, TableState]  # table -> ours


def desired_state(plan: Plan, family: int) -> State:
    out: State = {}
    for c in plan.chains_for(family):  # type: ignore[arg-type]
        ts = out.setdefault(c.table, TableState())
        name = PREFIX + c.name
        if c.hook:
            ts.jumps.append(f"-A {HOOK_CHAIN[c.hook]} -j {name}")
        ts.jumps.sort()  # as iptables-save lists them: OUTPUT before PREROUTING
        lines = [render_rule(name, r) for r in c.rules]
        any_ip = "0.0.0.0" if family == 4 else "::"
        ts.chains[name] = [ln.replace("{ANY}", any_ip) for ln in lines]
    return out


def parse_save(text: str) -> State:
    """Our chains and jumps from ``iptables-save`` output."""
    out: State = {}
    table = None
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
            continue
        if table is None or not line or line.startswith("#") or line == "COMMIT":
            continue
        if line.startswith(":"):
            name = line[1:].split()[0]
            if name.startswith(PREFIX):
                out.setdefault(table, TableState()).chains.setdefault(name, [])
            continue
        if not line.startswith("-A "):
            continue
        chain = line.split()[1]
        if chain.startswith(PREFIX):
            out.setdefault(table, TableState()).chains.setdefault(chain, []).append(line)
        elif chain in BUILTIN and f"-j {PREFIX}" in line:
            out.setdefault(table, TableState()).jumps.append(line)
    for s in out.values():
        s.jumps.sort()
    return {t: s for t, s in out.items() if not s.empty()}


def transition(current: State, desired: State) -> str:
    """A restore payload that turns our ``current`` state into ``desired`` (other rules untouched)."""
    blocks = []
    for table in sorted(set(current) | set(desired), key=lambda t: (TABLE_ORDER + (t,)).index(t)):
        cur = current.get(table, TableState())
        want = desired.get(table, TableState())
        if cur.chains == want.chains and cur.jumps == want.jumps:
            continue
        lines = [f"*{table}"]
        obsolete = [c for c in cur.chains if c not in want.chains]
        # Declaring a chain creates it, or flushes it if it exists (also with --noflush).
        for name in list(want.chains) + obsolete:
            lines.append(f":{name} - [0:0]")
        keep_jumps = cur.jumps == want.jumps
        if not keep_jumps:
            lines += ["-D" + j[2:] for j in cur.jumps]
        lines += [f"-X {name}" for name in obsolete]
        for rules in want.chains.values():
            lines += rules
        if not keep_jumps:
            lines += want.jumps
        lines.append("COMMIT")
        blocks.append("\n".join(lines))
    return "\n".join(blocks) + "\n" if blocks else ""


def payload_for(desired: State) -> str:
    """The plain payload of a desired state (what ``--dry-run`` prints)."""
    return transition({}, desired)


# --- execution -----------------------------------------------------------------------


def _tool(variant: str, family: int, kind: str) -> str:
    base = "iptables" if family == 4 else "ip6tables"
    name = f"{base}-{variant}-{kind}" if kind else f"{base}-{variant}"
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        raise BackendUnavailable(
            f"backend=iptables: {name} not found; install Debian's 'iptables' package (apt-get install iptables)"
        )
    return path


def _run(argv: list[str], stdin: str | None = None) -> str:
    from .nftables import forget_tables

    forget_tables()  # iptables-nft may add or delete tables
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        raise SetupError(f"{os.path.basename(argv[0])} did not finish in 30 s") from None
    if p.returncode != 0:
        raise SetupError(f"{os.path.basename(argv[0])} failed (exit {p.returncode}): {p.stderr.strip()}")
    return p.stdout


def detect_variant(forced: str | None = None) -> str:
    """``legacy`` or ``nft`` for the calling thread's netns (an existing ruleset wins)."""
    if forced:
        if forced not in VARIANTS:
            raise BackendUnavailable(f"iptables variant {forced!r}: expected one of {', '.join(VARIANTS)}")
        return forced
    # Legacy tables that exist in this netns are listed here (per netns, no exec needed).
    for fam_file in ("/proc/self/net/ip_tables_names", "/proc/self/net/ip6_tables_names"):
        try:
            with open(fam_file.replace("/self/", "/thread-self/")) as f:
                if f.read().strip():
                    return "legacy"
        except OSError:
            pass
    if _nft_xtables_present():
        return "nft"
    # Nothing here yet: follow the host's alternative.
    target = os.path.realpath(shutil.which("iptables") or "/usr/sbin/iptables")
    return "legacy" if "legacy" in os.path.basename(target) else "nft"


_XT_TABLES = ("raw", "mangle", "nat", "filter")
_T = TypeVar("_T")


def _nft_call(what: Callable[[Any], _T], default: _T) -> _T:
    """``what(ctx)`` with a libnftables context of this thread's netns (see FACTS.md), freed off the
    caller's path; ``default`` when the binding is missing."""
    from . import nftables as nb

    nft = nb.context_or_none()
    if nft is None:
        return default
    try:
        return what(nft)
    finally:
        nb.release(nft)


def _xtables_tables(nft: Any) -> list[tuple[str, str]]:
    """The (family, name) of the iptables-nft tables here."""
    from .nftables import table_names

    try:
        names = table_names(nft)
    except SetupError:
        return []
    return [(f, n) for f, n in names if f in ("ip", "ip6") and n in _XT_TABLES]


def _nft_xtables_present() -> bool:
    return _nft_call(lambda nft: bool(_xtables_tables(nft)), False)


def _nft_chains_of_ours() -> bool:
    """Whether iptables-nft holds any ``RDR_`` chain here (in-process listings, no exec; just the
    table list when there is no iptables-nft table, as in a pod of the nftables backend)."""
    import json

    def look(nft: Any) -> bool:
        for family in sorted({f for f, _ in _xtables_tables(nft)}):
            rc, out, _ = nft.cmd(f"list chains {family}")
            if rc != 0 or not out:
                continue
            for item in json.loads(out).get("nftables", []):
                c = item.get("chain")
                if c and c.get("table") in _XT_TABLES and str(c.get("name", "")).startswith(PREFIX):
                    return True
        return False

    return _nft_call(look, False)


def _drop_empty_xtables_nft() -> None:
    """Delete iptables-nft tables left with no rules and no user chains (as if never made).

    ``iptables-nft-restore`` creates a table with its built-in chains on first use;
    once ours are gone such a table holds nothing, so removing it restores the
    namespace exactly. A table with any rule, user chain or non-ACCEPT policy stays.
    """
    import json

    from .nftables import forget_tables

    def drop(nft: Any) -> None:
        for family, table in _xtables_tables(nft):
            rc, out, _ = nft.cmd(f"list table {family} {table}")
            if rc != 0:
                continue
            items = json.loads(out).get("nftables", [])
            chains = [i["chain"] for i in items if "chain" in i]
            if any("rule" in i or "set" in i or "map" in i for i in items):
                continue
            if all(c.get("type") and c.get("policy", "accept") == "accept" and c["name"].isupper() for c in chains):
                nft.cmd(f"delete table {family} {table}")
                forget_tables()

    _nft_call(drop, None)


class IptablesBackend:
    """Renders plans with ``iptables-restore``; ``variant`` forces legacy or nft."""

    def __init__(self, variant: str | None = None) -> None:
        self.variant_forced = variant
        self.name = "iptables" if variant is None else f"iptables-{variant}"

    # All methods act on the calling thread's netns (the caller entered it).

    def _variant(self) -> str:
        return detect_variant(self.variant_forced)

    def save(self, variant: str, family: int) -> str:
        return _run([_tool(variant, family, "save")])

    def restore(self, variant: str, family: int, payload: str) -> None:
        if payload:
            log.debug("%s-restore (IPv%d):\n%s", variant, family, payload)
            _run([_tool(variant, family, "restore"), "-w", "5", "--noflush"], payload)

    def render(self, plan: Plan, families: tuple[int, ...]) -> str:
        out = []
        for fam in families:
            out.append(f"# IPv{fam}: {'iptables' if fam == 4 else 'ip6tables'}-restore --noflush")
            out.append(payload_for(desired_state(plan, fam)).rstrip())
        return "\n".join(out) + "\n"

    def read(self, variant: str) -> dict[int, State]:
        """Our chains per family, from ``*tables-save``; a family without any table of that
        variant (a fresh pod) is read as empty without exec'ing the save."""
        have = self._families_with_tables(variant)
        return {fam: parse_save(self.save(variant, fam)) if fam in have else {} for fam in (4, 6)}

    def _families_with_tables(self, variant: str) -> set[int]:
        """The families that have any table of ``variant`` here (both when that can't be told)."""
        if variant == "legacy":
            out = set()
            for fam, f in ((4, "ip_tables_names"), (6, "ip6_tables_names")):
                try:
                    with open(f"/proc/thread-self/net/{f}") as fh:
                        if fh.read().strip():
                            out.add(fam)
                except OSError:
                    out.add(fam)
            return out
        tables = _nft_call(_xtables_tables, None)
        if tables is None:
            return {4, 6}
        return {4 if family == "ip" else 6 for family, _ in tables}

    def apply(self, plan: Plan, cfg: RedirectConfig, families: tuple[int, ...]) -> Installed:
        variant = self._variant()
        current = self.read(variant)
        desired = {fam: desired_state(plan, fam) if fam in families else {} for fam in (4, 6)}
        txn = rt.txn_for(plan, families)
        payloads = {fam: transition(current[fam], desired[fam]) for fam in (4, 6)}
        if not txn.changed and not any(payloads.values()):
            return Installed(self.name, "", families, False, {"variant": variant})
        applied: list[int] = []
        try:
            txn.apply()
            for fam in (4, 6):
                fault_point(f"iptables.before_restore_v{fam}")
                self.restore(variant, fam, payloads[fam])
                applied.append(fam)
            txn.finish()
        except BaseException as e:
            log.warning("setup failed (%s); rolling back", e)
            for fam in reversed(applied):
                try:
                    now = parse_save(self.save(variant, fam))
                    self.restore(variant, fam, transition(now, current[fam]))
                except Exception as re:  # pragma: no cover - reported, not hidden
                    log.error("rollback of IPv%d failed: %s", fam, re)
            if variant == "nft":
                _drop_empty_xtables_nft()
            try:
                txn.rollback()
            except Exception as re:  # pragma: no cover
                log.error("rollback of routes failed: %s", re)
            if isinstance(e, (SetupError, BackendUnavailable)):
                raise
            if isinstance(e, Exception):
                raise SetupError(f"setup failed and was rolled back: {e}") from e
            raise
        return Installed(self.name, "", families, True, {"variant": variant})

    def remove(self, keep_routes: bool = False) -> bool:
        changed = False
        for variant in VARIANTS:
            present = self._has_variant_state(variant) if variant == "legacy" else _nft_chains_of_ours()
            try:
                current = self.read(variant) if present else {}
            except BackendUnavailable:
                continue
            for fam, state in current.items():
                payload = transition(state, {})
                if payload:
                    self.restore(variant, fam, payload)
                    changed = True
            if variant == "nft" and current:
                _drop_empty_xtables_nft()
        if keep_routes:  # another backend's rules use them (switching backends)
            return changed
        return rt.remove_all_ours() or changed

    def _has_variant_state(self, variant: str) -> bool:
        if variant == "legacy":
            for f in ("ip_tables_names", "ip6_tables_names"):
                try:
                    with open(f"/proc/thread-self/net/{f}") as fh:
                        if fh.read().strip():
                            return True
                except OSError:
                    pass
            return False
        return _nft_xtables_present()

    def installed(self) -> bool:
        """Whether any chain of ours exists (cheap: no exec unless legacy tables exist)."""
        if _nft_chains_of_ours():
            return True
        return self._has_variant_state("legacy") and any(self.read("legacy").values())

    def check(self, plan: Plan, cfg: RedirectConfig, families: tuple[int, ...]) -> CheckResult:
        variant = self._variant()
        diffs: list[str] = []
        current = self.read(variant)
        for fam in (4, 6):
            want = desired_state(plan, fam) if fam in families else {}
            diffs += _diff_state(fam, current[fam], want)
        diffs += rt.differences(plan, families)
        return CheckResult(not diffs, self.name, tuple(diffs))

    def show(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name, "variants": {}}
        for variant in VARIANTS:
            if not self._has_variant_state(variant):
                continue
            st = self.read(variant)
            if any(st.values()):
                out["variants"][variant] = {
                    f"ipv{fam}": {t: {"jumps": s.jumps, "chains": s.chains} for t, s in state.items()}
                    for fam, state in st.items()
                    if state
                }
        out.update(rt.describe_ours())
        out["installed"] = bool(out["variants"])
        return out


def _diff_state(fam: int, cur: State, want: State) -> list[str]:
    diffs = []
    for table in sorted(set(cur) | set(want)):
        c = cur.get(table, TableState())
        w = want.get(table, TableState())
        for j in w.jumps:
            if j not in c.jumps:
                diffs.append(f"IPv{fam} {table}: missing jump: {j}")
        for j in c.jumps:
            if j not in w.jumps:
                diffs.append(f"IPv{fam} {table}: unexpected jump: {j}")
        for name in sorted(set(c.chains) | set(w.chains)):
            if name not in c.chains:
                diffs.append(f"IPv{fam} {table}: missing chain {name}")
            elif name not in w.chains:
                diffs.append(f"IPv{fam} {table}: unexpected chain {name}")
            elif c.chains[name] != w.chains[name]:
                for ln in w.chains[name]:
                    if ln not in c.chains[name]:
                        diffs.append(f"IPv{fam} {table}: missing rule: {ln}")
                for ln in c.chains[name]:
                    if ln not in w.chains[name]:
                        diffs.append(f"IPv{fam} {table}: unexpected rule: {ln}")
                if sorted(c.chains[name]) == sorted(w.chains[name]):
                    diffs.append(f"IPv{fam} {table}: rules of {name} are out of order")
    return diffs

