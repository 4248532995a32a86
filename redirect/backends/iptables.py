"""The iptables backend: ``iptables-restore --noflush`` payloads of our chains only.

What is ours. Our chains have exact names: a generation prefix (``RDR_`` or ``RDR2_``) and
one of the plan's chain names (``POD_CHAINS``); every rule of ours, and each jump from a
built-in chain into ours, carries the comment ``redirect: <purpose>``. A chain with one of
our names that holds no rule of ours and that no rule of ours jumps to is someone else's:
setup refuses, naming it, and nothing touches it. Other ``RDR_*`` chains (the node's
``RDR_NODE_POSTRT``, a firewall's ``RDR_MYFW``) are never looked at. Rules are rendered in
exactly the form ``iptables-save`` prints them, so what is installed is read back and compared
line by line (``check``), and a setup whose rules are already in place changes nothing. The
previous release's layout (no comments; bare ``-A OUTPUT -j RDR_OUTPUT`` and ``-A PREROUTING
-j RDR_PREROUTING`` jumps in raw, mangle or nat, and our chains reached from them) is
recognised as ours, and the next setup replaces it.

Order of a change (see ``IptablesBackend``): the new config goes in under the other
generation's names beside the old one, then the old one is removed, IPv4's nat table marking
the moment each generation is whole. ``iptables-restore`` commits table by table, so that is
the unit of atomicity; a failure while adding is rolled back, and a setup killed anywhere
leaves a state that the next setup finishes or undoes.

Teardown gives the ruleset back as it was: with iptables-nft, the built-in chains (nft base
chains) and tables that exist only because of our jumps are deleted with them. A legacy
xtables table that did not exist before setup stays, empty: the kernel has no way to remove
one from a namespace.

The variant (legacy xtables or nf_tables) is chosen per namespace: whichever one
already holds rules there wins; with neither, the host's ``iptables`` alternative.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..config import IdSpec, RedirectConfig
from ..errors import BackendUnavailable, SetupError
from ..kernel import routes as rt
from ..plan.vocabulary import (
    Accept,
    Action,
    Addr,
    ConnMark,
    CtState,
    CtZone,
    Drop,
    Iface,
    InSet,
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
    Snat,
    Socket,
    SocketExists,
    TProxy,
)
from .base import MARK, POD_CHAINS, CheckResult, Installed, fault_point, is_owned_comment, owned_comment

log = logging.getLogger("redirect.iptables")

#: Chain name prefixes of the two generations of our chains. A changed config is installed
#: under the other generation's names beside the installed one, then the old one is removed,
#: so no state in between captures less than one of the two configs.
GENERATIONS = ("RDR_", "RDR2_")
PREFIX = GENERATIONS[0]
#: A pod's chains are exactly ``POD_CHAINS`` under a generation prefix: other ``RDR_*`` chains
#: (the node's ``RDR_NODE_POSTRT``, anyone's) are not the pod's.
JUMP_COMMENT = f"{MARK}: capture"
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
    # iptables-save quotes every comment and escapes quotes and backslashes; the planner's have none.
    if any(c in text for c in "\"'\\"):
        raise ValueError(f"rule comment {text!r} must not contain quotes or backslashes")
    return f'"{text}"'


def render_rule(chain: str, rule: Rule, prefix: str = PREFIX) -> str:
    """One rule as ``iptables-save`` prints it (``-A CHAIN ...``), with our comment; jumps go to
    chains named with ``prefix``."""
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
        elif isinstance(x, SocketExists):
            parts += ["-m", "owner", "--socket-exists"]
        elif isinstance(x, InSet):
            parts += ["-m", "set", "--match-set", x.name, x.side]
        elif isinstance(x, Socket):
            parts += ["-m", "socket"]
            if x.transparent:
                parts.append("--transparent")
            if x.nowildcard:
                parts.append("--nowildcard")
    parts += ["-m", "comment", "--comment", _quote(owned_comment(rule.comment))]
    parts += _render_action(rule.action, prefix)
    return " ".join(parts)


def _render_action(a: Action, prefix: str = PREFIX) -> list[str]:
    if isinstance(a, Return):
        return ["-j", "RETURN"]
    if isinstance(a, Accept):
        return ["-j", "ACCEPT"]
    if isinstance(a, Drop):
        return ["-j", "DROP"]
    if isinstance(a, Jump):
        return ["-j", prefix + a.chain]
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
    if isinstance(a, Snat):
        return ["-j", "SNAT", "--to-source", a.address]
    raise TypeError(f"unknown action {a!r}")


@dataclass
class TableState:
    """Our part of one table: chains (name -> rule lines) and jumps from built-in chains."""

    chains: dict[str, list[str]] = field(default_factory=dict)
    jumps: list[str] = field(default_factory=list)  # '-A OUTPUT -m comment --comment "redirect: capture" -j RDR_OUTPUT'

    def empty(self) -> bool:
        return not self.chains and not self.jumps


State = dict[str, TableState]  # table -> ours


def _hook_jump(builtin: str, target: str) -> str:
    return f'-A {builtin} -m comment --comment "{JUMP_COMMENT}" -j {target}'


def _anchor(prefix: str) -> str:
    """The IPv4 nat jump into a generation's OUTPUT chain: every plan has it, a setup writes it
    last and removes it first, so a generation that has it is complete."""
    return _hook_jump("OUTPUT", prefix + "OUTPUT")


def desired_state(plan: Plan, family: int, gen: int = 0) -> State:
    """Our chains and jumps for ``plan`` in ``family``, under generation ``gen``'s names."""
    prefix = GENERATIONS[gen]
    out: State = {}
    for c in plan.chains_for(family):  # type: ignore[arg-type]
        if c.name not in POD_CHAINS:
            raise ValueError(f"plan chain {c.name!r} is not one of the pod chains {sorted(POD_CHAINS)}")
        ts = out.setdefault(c.table, TableState())
        name = prefix + c.name
        if c.hook:
            ts.jumps.append(_hook_jump(HOOK_CHAIN[c.hook], name))
        ts.jumps.sort()  # as iptables-save lists them: OUTPUT before PREROUTING
        lines = [render_rule(name, r, prefix=prefix) for r in c.rules]
        any_ip = "0.0.0.0" if family == 4 else "::"
        ts.chains[name] = [ln.replace("{ANY}", any_ip) for ln in lines]
    if family == 4 and _anchor(prefix) not in out.get("nat", TableState()).jumps:
        raise ValueError("a plan without an IPv4 nat OUTPUT chain (the generation's anchor)")
    return out


# --- reading back: what of an iptables-save dump is ours ------------------------------

_COMMENT_RE = re.compile(r' -m comment --comment "((?:[^"\\]|\\.)*)"')
_TARGET_RE = re.compile(r" -j (\S+)")


def _marked(line: str) -> bool:
    """The rule carries our comment (``redirect`` or ``redirect: ...``)."""
    m = _COMMENT_RE.search(line)
    return m is not None and is_owned_comment(m.group(1))


def _target(line: str) -> str | None:
    m = _TARGET_RE.search(line)
    return m.group(1) if m else None


def _gen_of(name: str) -> int | None:
    """The generation a chain name of ours belongs to (exact names only), else None."""
    for g, prefix in enumerate(GENERATIONS):
        if name.startswith(prefix) and name[len(prefix):] in POD_CHAINS:
            return g
    return None


@dataclass
class Found:
    """What a dump holds of ours, per generation, and what is named like ours but is not."""

    gens: tuple[State, State] = field(default_factory=lambda: ({}, {}))
    #: Objects named like ours that nothing marks as ours (refused by setup, never touched).
    foreign: list[str] = field(default_factory=list)


def _parse_tables(text: str) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """table -> (declared chains, rules per chain), from ``iptables-save`` output."""
    out: dict[str, tuple[list[str], dict[str, list[str]]]] = {}
    table = None
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
            out.setdefault(table, ([], {}))
            continue
        if table is None or not line or line.startswith("#") or line == "COMMIT":
            continue
        declared, rules = out[table]
        if line.startswith(":"):
            declared.append(line[1:].split()[0])
        elif line.startswith("-A "):
            rules.setdefault(line.split()[1], []).append(line)
    return out


def parse_save(text: str, family: int = 4) -> Found:
    """Our chains and jumps from ``iptables-save`` output, by generation.

    Ours: a chain with one of our exact names (a generation prefix + a pod chain name) that
    holds a rule with our comment or that a rule with our comment jumps to, and the rules
    with our comment in built-in chains that jump to one of ours. The layout of earlier
    versions (no comments: ``-A OUTPUT -j RDR_OUTPUT`` and ``-A PREROUTING -j RDR_PREROUTING``
    in raw, mangle or nat, and the chains of ours reached from them) is recognised as
    generation 0. A chain named like ours with nothing of that is listed in ``foreign``.
    """
    found = Found()
    for table, (declared, rules) in _parse_tables(text).items():
        ours_chains = [n for n in declared if _gen_of(n) is not None]
        jumped: set[str] = set()  # targets of rules with our mark
        for lines in rules.values():
            for ln in lines:
                t = _target(ln)
                if t is not None and _gen_of(t) is not None and _marked(ln):
                    jumped.add(t)
        # Earlier versions: unmarked exact hook jumps, and what they reach.
        legacy: set[str] = set()
        legacy_jumps: list[str] = []
        if table in TABLE_ORDER:
            todo = []
            for builtin in HOOK_CHAIN.values():
                line = f"-A {builtin} -j {GENERATIONS[0]}{builtin}"
                if line in rules.get(builtin, []) and GENERATIONS[0] + builtin in declared:
                    legacy_jumps.append(line)
                    todo.append(GENERATIONS[0] + builtin)
            while todo:
                name = todo.pop()
                if name in legacy:
                    continue
                legacy.add(name)
                for ln in rules.get(name, []):
                    t = _target(ln)
                    if t is not None and _gen_of(t) == 0 and t in declared:
                        todo.append(t)
        for name in ours_chains:
            g = _gen_of(name)
            assert g is not None
            mine = name in jumped or name in legacy or any(_marked(ln) for ln in rules.get(name, []))
            if not mine:
                found.foreign.append(f"IPv{family} {table} chain {name}")
                continue
            ts = found.gens[g].setdefault(table, TableState())
            ts.chains[name] = list(rules.get(name, []))
        for builtin in BUILTIN:
            for ln in rules.get(builtin, []):
                t = _target(ln)
                g = _gen_of(t) if t is not None else None
                if g is None:
                    continue
                if t not in found.gens[g].get(table, TableState()).chains:
                    continue  # a jump to someone else's chain of that name: theirs
                if (_marked(ln) and ln == _hook_jump(builtin, t)) or ln in legacy_jumps:
                    found.gens[g].setdefault(table, TableState()).jumps.append(ln)
                else:
                    found.foreign.append(f"IPv{family} {table} rule {ln!r} (jumps to our chain {t})")
    for st in found.gens:
        for s in st.values():
            s.jumps.sort()
        for t in [t for t, s in st.items() if s.empty()]:
            del st[t]
    return found


def _add_payload(want: State) -> str:
    """Install ``want`` (chains of a generation not present yet) beside whatever is there.

    Tables in ``TABLE_ORDER``: the IPv4 nat table, which holds the generation's anchor, is
    committed last (``iptables-restore`` commits table by table).
    """
    blocks = []
    for table in sorted(want, key=_table_rank):
        ts = want[table]
        lines = [f"*{table}"] + [f":{name} - [0:0]" for name in ts.chains]
        for rules in ts.chains.values():
            lines += rules
        lines += ts.jumps
        blocks.append("\n".join(lines + ["COMMIT"]))
    return "\n".join(blocks) + "\n" if blocks else ""


def _remove_payload(cur: State) -> str:
    """Remove ``cur`` (one generation of ours); the nat table (the anchor) first."""
    blocks = []
    for table in sorted(cur, key=_table_rank, reverse=True):
        ts = cur[table]
        lines = [f"*{table}"] + ["-D" + j[2:] for j in ts.jumps]
        lines += [f":{name} - [0:0]" for name in ts.chains]  # declaring flushes (also with --noflush)
        lines += [f"-X {name}" for name in ts.chains]
        blocks.append("\n".join(lines + ["COMMIT"]))
    return "\n".join(blocks) + "\n" if blocks else ""


def _table_rank(table: str) -> int:
    return TABLE_ORDER.index(table) if table in TABLE_ORDER else -1


def payload_for(desired: State) -> str:
    """The plain payload of a desired state (what ``--dry-run`` prints)."""
    return _add_payload(desired)


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


def save(variant: str, family: int, table: str | None = None) -> str:
    """``*tables-save`` of ``variant`` (``legacy``/``nft``) for ``family`` in the calling thread's
    netns: every table, or only ``table``."""
    return _run([_tool(variant, family, "save"), *(("-t", table) if table else ())])


def restore(variant: str, family: int, payload: str) -> None:
    """Apply ``payload`` with ``*tables-restore --noflush`` (each table commits as a whole); an
    empty payload does nothing."""
    if payload:
        log.debug("%s-restore (IPv%d):\n%s", variant, family, payload)
        _run([_tool(variant, family, "restore"), "-w", "5", "--noflush"], payload)


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
    """Whether iptables-nft holds a chain with one of our names here (in-process listings, no
    exec; just the table list when there is no iptables-nft table, as in a pod of the nftables
    backend). Whether it is truly ours is decided on the ``iptables-save`` dump (``parse_save``)."""
    import json

    def look(nft: Any) -> bool:
        for family in sorted({f for f, _ in _xtables_tables(nft)}):
            rc, out, _ = nft.cmd(f"list chains {family}")
            if rc != 0 or not out:
                continue
            for item in json.loads(out).get("nftables", []):
                c = item.get("chain")
                if c and c.get("table") in _XT_TABLES and _gen_of(str(c.get("name", ""))) is not None:
                    return True
        return False

    return _nft_call(look, False)


Hooked = set[tuple[int, str, str]]  # (family, table, built-in chain) we removed a jump of ours from


def _drop_empty_xtables_nft(hooked: Hooked) -> None:
    """Undo what iptables-nft made for us alone: it creates a built-in chain (an nft base chain)
    on first use, and its table with it. A built-in chain in ``hooked`` left with no rule and an
    accept policy is deleted, and so is a table left with no rule, no user chain and only such
    chains, as if we had never come (``nft list ruleset`` as before setup).
    """
    import json

    from .nftables import forget_tables

    def drop(nft: Any) -> None:
        for fam, table, chain in sorted(hooked):
            nfam = "ip" if fam == 4 else "ip6"
            rc, out, _ = nft.cmd(f"list chain {nfam} {table} {chain}")
            if rc != 0:
                continue
            items = json.loads(out).get("nftables", [])
            c: dict[str, Any] = next((i["chain"] for i in items if "chain" in i), {})
            if not any("rule" in i for i in items) and c.get("type") and c.get("policy", "accept") == "accept":
                nft.cmd(f"delete chain {nfam} {table} {chain}")
        for nfam, table in sorted({("ip" if f == 4 else "ip6", t) for f, t, _ in hooked}):
            rc, out, _ = nft.cmd(f"list table {nfam} {table}")
            if rc != 0:
                continue
            items = json.loads(out).get("nftables", [])
            chains = [i["chain"] for i in items if "chain" in i]
            if any("rule" in i or "set" in i or "map" in i for i in items):
                continue
            if all(c.get("type") and c.get("policy", "accept") == "accept" and c["name"] in BUILTIN for c in chains):
                nft.cmd(f"delete table {nfam} {table}")
        forget_tables()

    if hooked:
        _nft_call(drop, None)


def _hooked(fam: int, state: State) -> Hooked:
    return {(fam, table, j.split()[1]) for table, ts in state.items() for j in ts.jumps}


Read = dict[int, Found]  # family -> what the dump holds


def _gen_present(cur: Read, g: int) -> bool:
    return any(f.gens[g] for f in cur.values())


def _complete(cur: Read, g: int) -> bool:
    """Generation ``g`` holds its anchor: its setup finished adding it and no removal began (the
    previous release's bare jump counts for generation 0: it wrote each family in one go)."""
    jumps = cur[4].gens[g].get("nat", TableState()).jumps
    return _anchor(GENERATIONS[g]) in jumps or (g == 0 and f"-A OUTPUT -j {GENERATIONS[0]}OUTPUT" in jumps)


class IptablesBackend:
    """Renders plans with ``iptables-restore``; ``variant`` forces legacy or nft.

    Steps of a changed config (each ``iptables-restore`` commits table by table), every one
    of which leaves the namespace capturing at least what one of the two configs captures:

    1. routes and addresses the new config needs are added (``redirect.kernel.routes``);
    2. the new rules go in under the free generation's chain names, beside the old ones, their
       jumps appended after the old ones: IPv6 first, then IPv4 with the nat table last, whose
       jump into ``<gen>OUTPUT`` is the generation's anchor (present = complete);
    3. the old generation is removed: IPv4 first with its nat table (its anchor) first, then IPv6;
    4. routes and addresses only the old config needed are removed.

    Until step 2 ends the old rules decide first; from then on the new ones are all in. A setup
    that finds both generations (a setup was killed between 2 and 3) removes the one without
    its anchor (or, both complete, the one not wanted) before going on; ``check`` reports it.
    """

    def __init__(self, variant: str | None = None) -> None:
        self.variant_forced = variant
        self.name = "iptables" if variant is None else f"iptables-{variant}"

    # All methods act on the calling thread's netns (the caller entered it).

    def _variant(self) -> str:
        return detect_variant(self.variant_forced)

    def save(self, variant: str, family: int) -> str:
        return save(variant, family)

    def restore(self, variant: str, family: int, payload: str) -> None:
        restore(variant, family, payload)

    def render(self, plan: Plan, families: tuple[int, ...]) -> str:
        out = []
        for fam in families:
            out.append(f"# IPv{fam}: {'iptables' if fam == 4 else 'ip6tables'}-restore --noflush")
            out.append(payload_for(desired_state(plan, fam)).rstrip())
        return "\n".join(out) + "\n"

    def read(self, variant: str) -> Read:
        """What of ours each family holds, from ``*tables-save``; a family without any table of
        that variant (a fresh pod) is read as empty without exec'ing the save."""
        have = self._families_with_tables(variant)
        return {fam: parse_save(self.save(variant, fam), fam) if fam in have else Found() for fam in (4, 6)}

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

    def _remove_gen(self, variant: str, cur: Read, g: int, hooked: Hooked) -> None:
        """Remove generation ``g``: IPv4 (nat, its anchor, first), then IPv6."""
        for fam in (4, 6):
            state = cur[fam].gens[g]
            if state:
                fault_point(f"iptables.remove_v{fam}")
                self.restore(variant, fam, _remove_payload(state))
                hooked |= _hooked(fam, state)
                cur[fam].gens = (({}, cur[fam].gens[1]) if g == 0 else (cur[fam].gens[0], {}))

    def apply(self, plan: Plan, cfg: RedirectConfig, families: tuple[int, ...]) -> Installed:
        variant = self._variant()
        cur = self.read(variant)
        foreign = [x for f in cur.values() for x in f.foreign]
        if foreign:
            raise SetupError(
                f"{self.name}: named like ours but not ours (no rule carries our comment {MARK!r}), so left alone"
                f" and setup refused: {'; '.join(foreign)}. Rename or remove them (a chain of ours emptied by a"
                " flush looks like this too: delete it with -X)"
            )
        want = {g: {fam: desired_state(plan, fam, g) if fam in families else {} for fam in (4, 6)} for g in (0, 1)}

        def same(g: int) -> bool:
            return all(cur[fam].gens[g] == want[g][fam] for fam in (4, 6))

        present = [g for g in (0, 1) if _gen_present(cur, g)]
        keep = next((g for g in present if same(g)), None)
        txn = rt.txn_for(plan, families)
        if keep is not None and len(present) == 1 and not txn.changed:
            return Installed(self.name, "", families, False, {"variant": variant})
        hooked: Hooked = set()
        step, target = "routes", None
        try:
            txn.apply()
            if len(present) == 2:
                # An interrupted setup: drop the incomplete generation; both complete (it was killed
                # between the two steps), the one not wanted (either is a whole config).
                step = "resolve"
                incomplete = [g for g in present if not _complete(cur, g)]
                drop = incomplete[0] if len(incomplete) == 1 else (1 - keep if keep is not None else 0)
                log.warning("%s: an interrupted setup left two generations of our chains; removing %s*",
                            self.name, GENERATIONS[drop])
                self._remove_gen(variant, cur, drop, hooked)
                present.remove(drop)
            if keep is None or keep not in present:
                old = present[0] if present else None
                step, target = "add", (1 - old if old is not None else 0)
                for fam in (6, 4):  # IPv4 last: its nat table holds the anchor
                    fault_point(f"iptables.before_restore_v{fam}")
                    self.restore(variant, fam, _add_payload(want[target][fam]))
                step = "remove"
                if old is not None:
                    self._remove_gen(variant, cur, old, hooked)
            step = "finish"
            fault_point("iptables.before_routes_finish")
            txn.finish()
        except BaseException as e:
            self._rollback(variant, e, step, target, hooked, txn)
            raise
        finally:
            if variant == "nft":
                _drop_empty_xtables_nft(hooked)
        return Installed(self.name, "", families, True, {"variant": variant})

    def _rollback(self, variant: str, e: BaseException, step: str, target: int | None, hooked: Hooked,
                  txn: rt.RouteTxn) -> None:
        """After a failure in ``step``. Up to the end of adding generation ``target``: what of it
        went in and the routes added are removed. Once it is complete there is nothing to undo
        to: the error says so, and the next setup finishes the job (``check`` reports it)."""
        log.warning("setup failed at step %s (%s); rolling back", step, e)
        if step in ("remove", "finish"):
            if isinstance(e, Exception) and not isinstance(e, BackendUnavailable):
                raise SetupError(f"setup failed after the new rules were in ({e}): capture is in place; run setup"
                                 " again to remove what is left of the old config") from e
            return
        for fam in (4, 6) if target is not None else ():
            try:
                added = parse_save(self.save(variant, fam), fam).gens[target or 0]
                if added:
                    self.restore(variant, fam, _remove_payload(added))
                    hooked |= _hooked(fam, added)
            except Exception as re_:  # pragma: no cover - reported, not hidden
                log.error("rollback of IPv%d failed: %s", fam, re_)
        try:
            txn.rollback()
        except Exception as re_:  # pragma: no cover
            log.error("rollback of routes failed: %s", re_)
        if isinstance(e, Exception) and not isinstance(e, (SetupError, BackendUnavailable)):
            raise SetupError(f"setup failed and was rolled back: {e}") from e

    def remove(self, keep_routes: bool = False) -> bool:
        changed = False
        for variant in VARIANTS:
            present = self._has_variant_state(variant) if variant == "legacy" else _nft_chains_of_ours()
            try:
                cur = self.read(variant) if present else {}
            except BackendUnavailable:
                continue
            hooked: Hooked = set()
            for g in (0, 1):
                if cur and _gen_present(cur, g):
                    self._remove_gen(variant, cur, g, hooked)
                    changed = True
            for f in cur.values():
                for x in f.foreign:
                    log.warning("%s: left alone, named like ours but not ours: %s", self.name, x)
            if variant == "nft":
                _drop_empty_xtables_nft(hooked)
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
        """Whether any chain of ours exists (cheap: no exec unless tables with our names exist)."""
        if _nft_chains_of_ours() and any(_gen_present(self.read("nft"), g) for g in (0, 1)):
            return True
        return self._has_variant_state("legacy") and any(_gen_present(self.read("legacy"), g) for g in (0, 1))

    def check(self, plan: Plan, cfg: RedirectConfig, families: tuple[int, ...]) -> CheckResult:
        variant = self._variant()
        diffs: list[str] = []
        cur = self.read(variant)
        for f in cur.values():
            diffs += [f"not ours, named like ours: {x}" for x in f.foreign]
        present = [g for g in (0, 1) if _gen_present(cur, g)]
        if len(present) == 2:
            diffs.append(f"interrupted setup: two generations of our chains are installed ({GENERATIONS[0]}* and"
                         f" {GENERATIONS[1]}*); run setup again")
        g = next((g for g in present if _complete(cur, g)), present[0] if present else 0)
        for fam in (4, 6):
            want = desired_state(plan, fam, g) if fam in families else {}
            diffs += _diff_state(fam, cur[fam].gens[g], want)
        diffs += rt.differences(plan, families)
        return CheckResult(not diffs, self.name, tuple(diffs))

    def show(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name, "variants": {}}
        for variant in VARIANTS:
            if not self._has_variant_state(variant):
                continue
            cur = self.read(variant)
            shown = {}
            for fam, f in cur.items():
                merged: dict[str, Any] = {}
                for st in f.gens:
                    for t, s in st.items():
                        m = merged.setdefault(t, {"jumps": [], "chains": {}})
                        m["jumps"] += s.jumps
                        m["chains"].update(s.chains)
                if merged:
                    shown[f"ipv{fam}"] = merged
            if shown:
                out["variants"][variant] = shown
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
