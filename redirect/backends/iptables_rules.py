"""Our rules in iptables' own text: rendered from a plan exactly as ``iptables-save`` prints them
(``render_rule``, ``desired_state``, the ``iptables-restore`` payloads), and what of an
``iptables-save`` dump is ours (``parse_save``). Pure text: nothing here runs a tool, so all of
it is tested without root; the backend (``redirect.backends.iptables``) reads, writes and orders.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..config import IdSpec
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
    Match,
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
from .base import MARK, POD_CHAINS, is_owned_comment, list_differences, owned_comment

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


def anchor(prefix: str) -> str:
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
    if family == 4 and anchor(prefix) not in out.get("nat", TableState()).jumps:
        raise ValueError("a plan without an IPv4 nat OUTPUT chain (the generation's anchor)")
    return out


# --- reading back: what of an iptables-save dump is ours ------------------------------

_TARGETS: dict[str, Any] = {"RETURN": Return, "ACCEPT": Accept, "DROP": Drop}


def _mark_of(text: str) -> tuple[int, int]:
    value, _, mask = text.partition("/")
    return int(value, 16), int(mask, 16) if mask else FULL


def _idspec_of(text: str) -> Any:
    lo, _, hi = text.partition("-")
    return (int(lo), int(hi)) if hi else int(lo)


def _rule_of(tokens: list[str], prefix: str) -> tuple[str, Rule] | None:
    """(chain, rule) read from the tokens of one ``-A`` line, in the forms ``render_rule``
    writes; None for anything else. Lenient on purpose: what decides is whether ``render_rule``
    writes the rule back token for token (``_previous_release_rule``)."""
    if len(tokens) < 2 or tokens[0] != "-A":
        return None
    chain, comment, action, module = tokens[1], "", None, ""
    matches: list[Match] = []
    i, neg = 2, False
    while i < len(tokens):
        t = tokens[i]
        arg = tokens[i + 1] if i + 1 < len(tokens) else ""
        step = 2  # an option and its argument
        if t == "!":
            neg, i = True, i + 1
            continue
        if t in ("-s", "-d"):
            matches.append(Addr("src" if t == "-s" else "dst", arg, neg))
        elif t in ("-i", "-o"):
            matches.append(Iface("in" if t == "-i" else "out", arg, neg))
        elif t == "-p" and arg in ("tcp", "udp"):
            matches.append(Proto(arg))  # type: ignore[arg-type]
        elif t == "-m":
            module = arg
            if arg == "socket":
                flags = tokens[i + 2:i + 4]
                matches.append(Socket("--transparent" in flags, "--nowildcard" in flags))
                step += ("--transparent" in flags) + ("--nowildcard" in flags)
        elif t in ("--sport", "--dport"):
            matches.append(Port("src" if t == "--sport" else "dst", (int(arg),), neg))
        elif t in ("--sports", "--dports"):
            matches.append(Port("src" if t == "--sports" else "dst", tuple(int(p) for p in arg.split(",")), neg))
        elif t in ("--uid-owner", "--gid-owner"):
            matches.append(Owner("uid" if t == "--uid-owner" else "gid", _idspec_of(arg), neg))
        elif t == "--socket-exists":
            matches.append(SocketExists())
            step = 1
        elif t == "--mark" and module in ("mark", "connmark"):
            matches.append((Mark if module == "mark" else ConnMark)(*_mark_of(arg), neg))
        elif t == "--ctstate":
            matches.append(CtState(tuple(arg.split(","))))  # type: ignore[arg-type]
        elif t == "--match-set" and i + 2 < len(tokens):
            matches.append(InSet(arg, tokens[i + 2]))  # type: ignore[arg-type]
            step = 3
        elif t == "--comment" and not comment:
            comment = arg
        elif t == "-j":
            action = _action_of(arg, tokens[i + 2:], prefix)
            break
        else:
            return None
        neg, i = False, i + step
    if action is None:
        return None
    return chain, Rule(tuple(matches), action, None, comment)


def _action_of(target: str, args: list[str], prefix: str) -> Any:
    """The action of a ``-j TARGET ARGS...`` as ``_render_action`` writes it, or None."""
    opts = dict(zip(args[::2], args[1::2], strict=False))
    if target in _TARGETS and not args:
        return _TARGETS[target]()
    if target.startswith(prefix) and target[len(prefix):] in POD_CHAINS and not args:
        return Jump(target[len(prefix):])
    if target == "REDIRECT":
        return Redirect(int(opts["--to-ports"]))
    if target == "TPROXY":
        return TProxy(int(opts["--on-port"]), *_mark_of(opts["--tproxy-mark"]))
    if target in ("MARK", "CONNMARK") and "--set-xmark" in opts:
        return (SetMark if target == "MARK" else SetConnMark)(*_mark_of(opts["--set-xmark"]))
    if target == "CONNMARK" and args[:1] in (["--save-mark"], ["--restore-mark"]):
        return (SaveMark if args[0] == "--save-mark" else RestoreMark)(int(args[2], 16))
    if target == "CT":
        return CtZone(int(opts["--zone"]))
    if target == "SNAT":
        return Snat(opts["--to-source"])
    return None


def _previous_release_rule(line: str, family: int, toks: list[str] | None = None) -> bool:
    """Whether ``line`` is a rule exactly as the previous release wrote it: what ``render_rule``
    writes, with the rule's purpose as the whole comment instead of ``redirect: <purpose>``
    (the previous release's only difference), its jumps to chains of generation 0."""
    try:
        toks = tokens(line) if toks is None else toks
        parsed = _rule_of(toks, PREFIX)
        if parsed is None or not parsed[1].comment or is_owned_comment(parsed[1].comment):
            return False
        chain, rule = parsed
        marked = tokens(render_rule(chain, rule).replace("{ANY}", "0.0.0.0" if family == 4 else "::"))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False
    at = marked.index("--comment") + 1
    return marked[:at] + [rule.comment] + marked[at + 1:] == toks


class Unreadable(ValueError):
    """A dump that can't be read safely: a rule whose quoting does not close on its line (a string
    with a newline in it, which ``iptables-save`` does not escape), a line of no known form."""


#: One token of a rule as ``iptables-save`` writes it: a string in double quotes (``\"``, ``\\``
#: and ``\'`` escaped: ``xtables_save_string``), or a word without quotes or backslashes; either
#: ends at a space or the end of the line.
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"(?= |$)|([^ "\\]+)(?= |$)')
_ESCAPE = re.compile(r"\\(.)")


def tokens(line: str) -> list[str]:
    """The tokens of one dump line, quotes as ``iptables-save`` writes them; ``Unreadable`` if a
    quote does not close on the line or a word holds a quote or backslash."""
    if '"' not in line and "\\" not in line:
        return [t for t in line.split(" ") if t]
    out: list[str] = []
    i, n = 0, len(line)
    while i < n:
        if line[i] == " ":
            i += 1
            continue
        m = _TOKEN.match(line, i)
        if m is None:
            raise Unreadable(f"a quoted string that does not end on its line (a newline in it?), or a quote"
                             f" inside a word: {line!r}; such a rule could jump into ours unseen: remove it or"
                             " rewrite it without a newline")
        out.append(_ESCAPE.sub(r"\1", m.group(1)) if m.group(2) is None else m.group(2))
        i = m.end()
    return out


def _targets(toks: list[str]) -> list[str]:
    """Every chain or target a rule's tokens name after ``-j`` (jump) or ``-g`` (goto): a quoted
    string is one token, so a comment that mentions ``-j X`` names nothing."""
    return [toks[i + 1] for i in range(len(toks) - 1) if toks[i] in ("-j", "-g")]


def _marked(toks: list[str]) -> bool:
    """The rule carries our comment (``redirect`` or ``redirect: ...``) as its first comment."""
    for i in range(len(toks) - 1):
        if toks[i] == "--comment":
            return is_owned_comment(toks[i + 1])
    return False


def gen_of(name: str) -> int | None:
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
    #: Rules not ours inside chains of ours, or jumping into them: ours cannot be changed or
    #: removed without touching them, so setup and teardown refuse, naming them.
    intruders: list[str] = field(default_factory=list)


#: What iptables-nft-save prints instead of a table (``is incompatible``) or beside it (``contains
#: incompatible base-chains``, left out of the dump) that nft made in a way it can't translate.
_INCOMPATIBLE = re.compile(r"# Table `([^']*)' .*incompatible")
Rules = dict[str, list[tuple[str, list[str]]]]  # chain -> its rules (line, tokens), in order


def _parse_tables(text: str) -> dict[str, tuple[list[str], Rules]]:
    """table -> (declared chains, rules per chain), from ``iptables-save`` output; ``Unreadable``
    for a line of no form ``iptables-save`` writes (the rest of a string with a newline in it),
    a rule whose quoting does not close on its line, or a raw, mangle or nat table iptables-nft
    says it cannot show (whatever it holds is unseen: not an empty table)."""
    out: dict[str, tuple[list[str], Rules]] = {}
    table = None
    for line in text.split("\n"):  # (not splitlines: a quoted \x1c or \u2028 is no line break)
        if line.startswith("*"):
            table = line[1:].strip()
            out.setdefault(table, ([], {}))
            continue
        if not line:
            continue
        if line.startswith("#"):
            m = _INCOMPATIBLE.match(line)
            if m is not None and m.group(1) in TABLE_ORDER:
                raise Unreadable(
                    f"table {m.group(1)} holds what iptables-nft cannot show ({line[2:]!r}): rules made with nft"
                    f" there could jump into ours or be ours unseen. Use the nftables backend in this netns"
                    f" (backend='nftables'), or remove what nft made in table {m.group(1)}")
            continue
        if table is None:
            raise Unreadable(f"a line outside any table: {line!r}")
        if line == "COMMIT":
            table = None
            continue
        declared, rules = out[table]
        if line.startswith(":"):
            declared.append(line[1:].split(" ")[0])
        elif line.startswith("-A "):
            toks = tokens(line)
            rules.setdefault(toks[1], []).append((line, toks))
        else:
            raise Unreadable(f"a line of no form iptables-save writes in table {table}: {line!r} (the rest of a"
                             " string with a newline in it?)")
    return out


def _previous_release(table: str, declared: set[str], rules: Rules,
                      family: int) -> tuple[set[str], list[str]]:
    """The previous release's chains in one table (and its bare hook jumps into them), or
    nothing. It wrote no mark: bare ``-A OUTPUT -j RDR_OUTPUT`` / ``-A PREROUTING -j
    RDR_PREROUTING`` jumps in raw, mangle or nat, and generation-0 chains reached from them,
    every rule of which is exactly as it rendered rules (``_previous_release_rule``). All of
    them or none: one chain reached with any other rule (a DNAT of someone's ``RDR_PREROUTING``,
    a rule without a comment) makes all of it not ours, and so does a set of chains without
    a single rule."""
    if table not in TABLE_ORDER:
        return set(), []
    chains: set[str] = set()
    jumps: list[str] = []
    todo = []
    for builtin in HOOK_CHAIN.values():
        line = f"-A {builtin} -j {GENERATIONS[0]}{builtin}"
        if any(ln == line for ln, _ in rules.get(builtin, [])) and GENERATIONS[0] + builtin in declared:
            jumps.append(line)
            todo.append(GENERATIONS[0] + builtin)
    while todo:
        name = todo.pop()
        if name in chains:
            continue
        chains.add(name)
        for ln, toks in rules.get(name, []):
            if not _previous_release_rule(ln, family, toks):
                return set(), []
            for t in _targets(toks):
                if gen_of(t) == 0:
                    if t not in declared:
                        return set(), []
                    todo.append(t)
    if not any(rules.get(name) for name in chains):
        return set(), []
    return chains, jumps


def parse_save(text: str, family: int = 4) -> Found:
    """Our chains and jumps from ``iptables-save`` output, by generation.

    Ours: a chain with one of our exact names (a generation prefix + a pod chain name) that
    holds a rule with our comment or that a rule with our comment jumps to, and the rules
    with our comment in built-in chains that jump to one of ours. The previous release's
    layout (no mark; ``_previous_release``) is recognised as generation 0. A chain named like
    ours with nothing of that is listed in ``foreign``; a rule without our mark in a chain of
    ours, or one of someone else's jumping into ours, in ``intruders``.
    """
    found = Found()
    for table, (declared, rules) in _parse_tables(text).items():
        ours_chains = [n for n in declared if gen_of(n) is not None]
        jumped: set[str] = set()  # targets of rules with our mark
        for lines in rules.values():
            for _, toks in lines:
                if _marked(toks):
                    jumped.update(t for t in _targets(toks) if gen_of(t) is not None)
        legacy, legacy_jumps = _previous_release(table, set(declared), rules, family)  # (a set: one lookup a rule)
        for name in ours_chains:
            g = gen_of(name)
            assert g is not None
            lines = rules.get(name, [])
            if name in legacy:
                mine = [ln for ln, _ in lines]
            elif name in jumped or any(_marked(toks) for _, toks in lines):
                mine = [ln for ln, toks in lines if _marked(toks)]
                found.intruders += [f"IPv{family} {table} rule {ln!r} in our chain {name} (no comment {MARK!r})"
                                    for ln, toks in lines if not _marked(toks)]
            else:
                found.foreign.append(f"IPv{family} {table} chain {name}")
                continue
            ts = found.gens[g].setdefault(table, TableState())
            ts.chains[name] = mine
        for chain, lines in rules.items():
            if any(chain in st.get(table, TableState()).chains for st in found.gens):
                continue  # (ours: above)
            for ln, toks in lines:
                # Every chain the rule names after -j or -g (a comment is one token: it names none).
                into = [(t, g) for t in _targets(toks) if (g := gen_of(t)) is not None
                        and t in found.gens[g].get(table, TableState()).chains]
                if not into:
                    continue  # not a jump into one of ours (a look-alike of that name is theirs)
                t, g = into[0]
                if (len(into) == 1 and chain in BUILTIN
                        and ((_marked(toks) and ln == _hook_jump(chain, t)) or ln in legacy_jumps)):
                    found.gens[g].setdefault(table, TableState()).jumps.append(ln)
                else:
                    found.intruders.append(f"IPv{family} {table} rule {ln!r} (jumps to our chain"
                                           f" {', '.join(t for t, _ in into)})")
    for st in found.gens:
        for s in st.values():
            s.jumps.sort()
        for t in [t for t, s in st.items() if s.empty()]:
            del st[t]
    return found


def add_payload(want: State) -> str:
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


def remove_payload(cur: State) -> str:
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
    return add_payload(desired)


def diff_state(fam: int, cur: State, want: State) -> list[str]:
    """``check``'s differences between what is installed and what is wanted, for one family."""
    diffs = []
    for table in sorted(set(cur) | set(want)):
        c = cur.get(table, TableState())
        w = want.get(table, TableState())
        diffs += list_differences(f"IPv{fam} {table}", "jump", c.jumps, w.jumps)
        for name in sorted(set(c.chains) | set(w.chains)):
            if name not in c.chains:
                diffs.append(f"IPv{fam} {table}: missing chain {name}")
            elif name not in w.chains:
                diffs.append(f"IPv{fam} {table}: unexpected chain {name}")
            elif c.chains[name] != w.chains[name]:
                diffs += list_differences(f"IPv{fam} {table}", "rule", c.chains[name], w.chains[name])
                if sorted(c.chains[name]) == sorted(w.chains[name]):
                    diffs.append(f"IPv{fam} {table}: rules of {name} are out of order")
    return diffs
