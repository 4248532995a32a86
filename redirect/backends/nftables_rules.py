"""Our table in nft's own JSON: rendered from a plan exactly as ``nft -j list`` prints it
(``desired_ruleset``, ``commands_for``), read back from a listing (``parse_listing``), and as
the text ``nft list`` prints (``ruleset_text``: ``render``'s output and the goldens; ``expr_text``
in ``check``'s differences, ``diff_rulesets``). Pure data: nothing here runs
libnftables, so all of it is tested without root; the backend (``redirect.backends.nftables``)
reads, writes and orders.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

from ..config import IdSpec
from ..errors import BackendUnavailable
from ..plan.vocabulary import (
    Accept,
    Action,
    Addr,
    Chain,
    ConnMark,
    CtState,
    CtZone,
    Drop,
    Iface,
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
    Socket,
    TProxy,
)
from .base import POD_CHAINS, list_differences, owned_comment

FAMILY = "inet"
TABLE = "rdr_redirect"
FULL = 0xFFFFFFFF
TABLE_OBJ = {"family": FAMILY, "name": TABLE}
_NFPROTO = {4: "ipv4", 6: "ipv6"}
_IPPROTO = {4: "ip", 6: "ip6"}

#: (plan table, hook) -> (nft chain type, priority): where iptables' tables sit.
BASE_CHAINS: dict[tuple[str, str], tuple[str, int]] = {
    ("raw", "prerouting"): ("filter", -300),
    ("raw", "output"): ("filter", -300),
    ("mangle", "prerouting"): ("filter", -150),
    ("mangle", "input"): ("filter", -150),
    ("mangle", "forward"): ("filter", -150),
    ("mangle", "output"): ("route", -150),
    ("mangle", "postrouting"): ("filter", -150),
    ("nat", "prerouting"): ("nat", -100),
    ("nat", "output"): ("nat", -100),
    ("nat", "input"): ("nat", 100),
    ("nat", "postrouting"): ("nat", 100),
}

Expr = list[dict[str, Any]]



# --- rendering: plan -> our table, in the exact JSON form nft lists it ------------------


@dataclass
class ChainSpec:
    """One chain of our table: base-chain attributes (or None) and its rules."""

    base: dict[str, Any] | None
    rules: list[tuple[Expr, str]]  # (expr, comment)


Ruleset = dict[str, ChainSpec]  # chain name -> spec, in creation order


def chain_name(table: str, name: str) -> str:
    return f"{table}_{name}"


def _match(left: Any, right: Any, neg: bool = False, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": "!=" if neg else op, "left": left, "right": right}}


def _meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def _ct(key: str) -> dict[str, Any]:
    return {"ct": {"key": key}}


def _addr_right(cidr: str) -> Any:
    net = ipaddress.ip_network(cidr, strict=False)
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return {"prefix": {"addr": str(net.network_address), "len": net.prefixlen}}


def _ifname(name: str) -> str:
    # iptables: a trailing "+" is a prefix wildcard; nft writes it "*" (a literal "*" is "\*").
    name = name.replace("\\", "\\\\").replace("*", "\\*")
    return name[:-1] + "*" if name.endswith("+") else name


def _id_right(i: IdSpec) -> Any:
    return {"range": [i[0], i[1]]} if isinstance(i, tuple) else i


def _masked(key: dict[str, Any], mask: int) -> Any:
    return key if mask == FULL else {"&": [key, mask]}


def _set_value(key: dict[str, Any], value: int, mask: int) -> Any:
    """``key = (key & ~mask) ^ value`` (iptables ``--set-xmark``), as nft lists it."""
    if mask == FULL:
        return value
    keep = ~mask & FULL
    if value & keep:
        return {"^": [{"&": [key, keep]}, value]}
    return {"|": [{"&": [key, keep | value]}, value]}


def _render_match(m: Match, rule: Rule, has_port: bool) -> list[dict[str, Any]]:
    if isinstance(m, Proto):
        return [] if has_port else [_match(_meta("l4proto"), m.name)]
    if isinstance(m, Addr):
        fam = 4 if ipaddress.ip_network(m.cidr, strict=False).version == 4 else 6
        if ipaddress.ip_network(m.cidr, strict=False).prefixlen == 0:
            # "ip daddr 0.0.0.0/0" is "any IPv4 packet"; its negation matches nothing of IPv4.
            return [_match(_meta("nfproto"), _NFPROTO[fam], m.neg)]
        left = {"payload": {"protocol": _IPPROTO[fam], "field": f"{m.side[0]}addr"}}
        return [_match(left, _addr_right(m.cidr), m.neg)]
    if isinstance(m, Port):
        proto = next((p.name for p in rule.matches if isinstance(p, Proto)), None)
        if proto is None:
            raise ValueError(f"port match without protocol in {rule}")
        right: Any = m.ports[0] if len(m.ports) == 1 else {"set": sorted(m.ports)}
        return [_match({"payload": {"protocol": proto, "field": f"{m.side[0]}port"}}, right, m.neg)]
    if isinstance(m, Iface):
        return [_match(_meta(f"{m.side[0]}ifname"), _ifname(m.name), m.neg)]
    if isinstance(m, Owner):
        return [_match(_meta(f"sk{m.kind}"), _id_right(m.id), m.neg)]
    if isinstance(m, Mark):
        return [_match(_masked(_meta("mark"), m.mask), m.value, m.neg)]
    if isinstance(m, ConnMark):
        return [_match(_masked(_ct("mark"), m.mask), m.value, m.neg)]
    if isinstance(m, CtState):
        states = sorted(s.lower() for s in m.states)
        return [_match(_ct("state"), states[0] if len(states) == 1 else states, op="in")]
    if isinstance(m, Socket):
        out = []
        if m.transparent:
            out.append(_match({"socket": {"key": "transparent"}}, 1))
        if not m.nowildcard:
            out.append(_match({"socket": {"key": "wildcard"}}, 0))
        if not out:  # "a socket exists", wildcard ones included
            out.append(_match({"socket": {"key": "transparent"}}, {"set": [0, 1]}))
        return out
    raise TypeError(f"unknown match {m!r}")


def _render_action(a: Action, table: str, family: int | None) -> list[dict[str, Any]]:
    if isinstance(a, Return):
        return [{"return": None}]
    if isinstance(a, Accept):
        return [{"accept": None}]
    if isinstance(a, Drop):
        return [{"drop": None}]
    if isinstance(a, Jump):
        return [{"jump": {"target": chain_name(table, a.chain)}}]
    if isinstance(a, Redirect):
        return [{"redirect": {"port": a.port}}]
    if isinstance(a, TProxy):
        tp: dict[str, Any] = {"port": a.port}
        if family is not None:
            tp = {"family": _IPPROTO[family], "port": a.port}
        return [{"tproxy": tp}, {"mangle": {"key": _meta("mark"), "value": _set_value(_meta("mark"), a.mark, a.mask)}},
                {"accept": None}]
    if isinstance(a, SetMark):
        return [{"mangle": {"key": _meta("mark"), "value": _set_value(_meta("mark"), a.value, a.mask)}}]
    if isinstance(a, SetConnMark):
        return [{"mangle": {"key": _ct("mark"), "value": _set_value(_ct("mark"), a.value, a.mask)}}]
    if isinstance(a, (SaveMark, RestoreMark)):
        if a.mask != FULL:
            raise BackendUnavailable(
                f"backend=nftables: {type(a).__name__}(mask={a.mask:#x}) needs an OR of two registers, which"
                " nftables 1.0.6 cannot express; use backend=iptables for this config"
            )
        if isinstance(a, SaveMark):
            return [{"mangle": {"key": _ct("mark"), "value": _meta("mark")}}]
        return [{"mangle": {"key": _meta("mark"), "value": _ct("mark")}}]
    if isinstance(a, CtZone):
        return [{"mangle": {"key": _ct("zone"), "value": a.zone}}]
    raise TypeError(f"unknown action {a!r}")


def render_rule(table: str, rule: Rule) -> list[Expr]:
    """The expression list(s) of one plan rule (two for ``TProxy``: deliver, else drop)."""
    has_port = any(isinstance(m, Port) for m in rule.matches)
    matches: Expr = []
    for m in rule.matches:
        matches += _render_match(m, rule, has_port)
    if rule.family is not None and not any(isinstance(m, Addr) for m in rule.matches):
        matches.insert(0, _match(_meta("nfproto"), _NFPROTO[rule.family]))
    out = [matches + _render_action(rule.action, table, rule.family)]
    if isinstance(rule.action, TProxy):
        out.append(matches + [{"drop": None}])  # iptables' TPROXY drops when no socket is found
    return out


def _chains(plan: Plan, families: tuple[int, ...]) -> tuple[Chain, ...]:
    """The plan's chains with only the rules of ``families``; empty hook chains and
    chains nothing jumps to are dropped (as ``Plan.chains_for`` does per family)."""
    chains = []
    for c in plan.chains:
        rules = tuple(r for r in c.rules if r.family is None or r.family in families)
        if c.hook is not None and not rules:
            continue
        chains.append(Chain(c.table, c.name, rules, c.hook))
    while True:
        used = {(c.table, r.action.chain) for c in chains for r in c.rules if isinstance(r.action, Jump)}
        kept = [c for c in chains if c.hook is not None or (c.table, c.name) in used]
        if len(kept) == len(chains):
            return tuple(kept)
        chains = kept


def desired_ruleset(plan: Plan, families: tuple[int, ...]) -> Ruleset:
    """Our table for ``plan``, in the form nft lists it back (so it can be compared)."""
    out: Ruleset = {}
    skipped = [f for f in (4, 6) if f not in families]
    for c in _chains(plan, families):
        name = chain_name(c.table, c.name)
        base = None
        rules: list[tuple[Expr, str]] = []
        if c.hook is not None:
            try:
                typ, prio = BASE_CHAINS[(c.table, c.hook)]
            except KeyError:
                raise BackendUnavailable(
                    f"backend=nftables: no base chain for table {c.table!r} hook {c.hook!r}"
                ) from None
            base = {"type": typ, "hook": c.hook, "prio": prio, "policy": "accept"}
            for f in skipped:
                rules.append(([_match(_meta("nfproto"), _NFPROTO[f]), {"return": None}],
                              owned_comment(f"IPv{f} is not captured")))
        if c.name not in POD_CHAINS:
            raise ValueError(f"plan chain {c.name!r} is not one of the pod chains {sorted(POD_CHAINS)}")
        for r in c.rules:
            for expr in render_rule(c.table, r):
                rules.append((expr, owned_comment(r.comment)))
        if name in out:
            raise ValueError(f"two plan chains render to the nft chain {name}")
        out[name] = ChainSpec(base, rules)
    return out


#: ``desired_ruleset`` once per (plan, families): the result is shared, never to be modified.
cached_ruleset: functools._lru_cache_wrapper[Ruleset] = functools.lru_cache(maxsize=256)(desired_ruleset)


def commands_for(desired: Ruleset, fresh: bool = False) -> list[dict[str, Any]]:
    """One batch replacing our table by ``desired`` (an empty ruleset deletes it).

    ``fresh``: the table was not there when read. Then the batch creates it (``create`` fails if
    a table of that name exists) instead of deleting it: should someone have made one since it was
    read, the whole batch is refused and their table is left as it is (never flushed, nor ours
    merged into it); and nothing is deleted, whose deferred destruction makes freeing the context
    wait for an RCU grace period.
    """
    if fresh and desired:
        cmds: list[dict[str, Any]] = [{"create": {"table": dict(TABLE_OBJ)}}]
    else:
        cmds = [{"add": {"table": dict(TABLE_OBJ)}}, {"delete": {"table": dict(TABLE_OBJ)}}]
        if not desired:
            return cmds
        cmds.append({"add": {"table": dict(TABLE_OBJ)}})
    for name, spec in desired.items():
        cmds.append({"add": {"chain": {"family": FAMILY, "table": TABLE, "name": name, **(spec.base or {})}}})
    for name, spec in desired.items():
        for expr, comment in spec.rules:
            rule: dict[str, Any] = {"family": FAMILY, "table": TABLE, "chain": name, "expr": expr}
            if comment:
                rule["comment"] = comment
            cmds.append({"add": {"rule": rule}})
    return cmds


def parse_listing(items: list[dict[str, Any]]) -> Ruleset:
    """Our table from the JSON of ``list table inet rdr_redirect``."""
    out: Ruleset = {}
    for it in items:
        if "chain" in it:
            c = it["chain"]
            base = {k: c[k] for k in ("type", "hook", "prio", "policy") if k in c} or None
            out[c["name"]] = ChainSpec(base, [])
    for it in items:
        if "rule" in it:
            r = it["rule"]
            out.setdefault(r["chain"], ChainSpec(None, [])).rules.append((r["expr"], r.get("comment", "")))
    return out


#: The families nft lists tables of.
_FAMILIES = ("ip", "ip6", "inet", "arp", "bridge", "netdev")
_TABLE_LINE = re.compile(r"table (" + "|".join(_FAMILIES) + r") (\S.*)")


def parse_table_names(text: str) -> list[tuple[str, str]]:
    """(family, name) of each table in the text of ``nft list tables`` (one ``table <family> <name>``
    a line); ``ValueError`` naming a line of any other form. (Text, not JSON: libnftables 1.0.6 writes a
    table with flags, ``flags dormant``, as broken JSON and can corrupt its heap doing so.)"""
    out = []
    for line in text.splitlines():
        if not line:
            continue
        m = _TABLE_LINE.fullmatch(line)
        if m is None:
            raise ValueError(f"unexpected line in the list of tables: {line[:200]!r}")
        out.append((m[1], m[2]))
    return out


def parse_table_text(text: str) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """From the text of ``nft list table <family> <name>``: the table's flags, and each object in it
    other than a chain (a set, counter, comment ...) as a listing item ``{kind: {"name": name}}``, as
    ``not_ours`` and ``_split`` name them. Its top level is what is indented by one tab; a line there
    that is not a chain, a flags line or a closing brace is such an object (text that merely looks
    like one, in a name with a newline, can only add to them: never hide one)."""
    flags: list[str] = []
    others: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line.startswith("\t") or line.startswith("\t\t"):
            continue
        entry = line[1:].rstrip()
        if entry in ("}", "") or entry.startswith("chain "):
            continue
        if entry.startswith("flags "):
            flags += [f for f in re.split(r"[,\s]+", entry[len("flags "):]) if f]
            continue
        head = entry[:-1].rstrip() if entry.endswith("{") else entry
        kind, _, name = head.rpartition(" ")
        others.append({kind or head: {"name": name if kind else ""}})
    return tuple(flags), others


# --- nft's own text: what ``nft list table inet rdr_redirect`` prints ----------------------

#: ``ct state`` bits in the order nft prints them.
_CT_STATES = ("invalid", "established", "related", "new", "untracked")
#: nft's names of the standard priorities (any hook), and of the NAT ones (only on their hook).
_PRIO_NAMES = {-300: "raw", -150: "mangle", 0: "filter", 50: "security"}
_NAT_PRIO_NAMES = {("prerouting", -100): "dstnat", ("postrouting", 100): "srcnat"}
#: Keys whose values nft prints as 32-bit hex (marks).
_HEX_KEYS = (("meta", "mark"), ("ct", "mark"))


def _key(v: Any) -> tuple[str, str] | None:
    """(kind, key) of a ``meta``/``ct``/``socket`` expression, else None."""
    for kind in ("meta", "ct", "socket"):
        if isinstance(v, dict) and kind in v:
            return kind, v[kind]["key"]
    return None


def _left_text(v: Any) -> str:
    if isinstance(v, dict):
        if "meta" in v:
            key = v["meta"]["key"]
            return key if key in ("iifname", "oifname") else f"meta {key}"
        if "ct" in v:
            return f"ct {v['ct']['key']}"
        if "payload" in v:
            return f"{v['payload']['protocol']} {v['payload']['field']}"
        if "socket" in v:
            return f"socket {v['socket']['key']}"
        for op in ("&", "|", "^"):
            if op in v:
                a, b = v[op]
                return f"{_left_text(a)} {op} {_value_text(b, _hex_of(a))}"
    raise ValueError(f"nft text: no rendering of {v!r}")


def _hex_of(left: Any) -> bool:
    """Whether the values compared with (or set into) ``left`` are marks (printed as hex)."""
    while isinstance(left, dict) and any(op in left for op in ("&", "|", "^")):
        left = next(left[op][0] for op in ("&", "|", "^") if op in left)
    return _key(left) in _HEX_KEYS


def _value_text(v: Any, hexa: bool = False, quote: bool = False) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return f"0x{v:08x}" if hexa else str(v)
    if isinstance(v, str):
        return f'"{v}"' if quote else v
    if isinstance(v, list):  # ct state
        return ",".join(sorted(v, key=lambda x: _CT_STATES.index(x) if x in _CT_STATES else len(_CT_STATES)))
    if isinstance(v, dict):
        if "prefix" in v:
            return f"{v['prefix']['addr']}/{v['prefix']['len']}"
        if "range" in v:
            return f"{v['range'][0]}-{v['range'][1]}"
        if "set" in v:
            return "{ " + ", ".join(_value_text(x, hexa, quote) for x in v["set"]) + " }"
        if _key(v) is not None or "payload" in v or any(op in v for op in ("&", "|", "^")):
            return _left_text(v)
    raise ValueError(f"nft text: no rendering of value {v!r}")


def _match_text(m: dict[str, Any]) -> str:
    left, right, op = m["left"], m["right"], m["op"]
    binop = isinstance(left, dict) and any(o in left for o in ("&", "|", "^"))
    shown_op = "" if op == "in" or (op == "==" and not binop) else f"{op} "
    quote = _key(left) in (("meta", "iifname"), ("meta", "oifname"))
    return f"{_left_text(left)} {shown_op}{_value_text(right, _hex_of(left), quote)}"


def expr_text(expr: Expr, comment: str = "") -> str:
    """One rule of ours as ``nft list`` prints it."""
    parts = []
    for e in expr:
        try:
            parts.append(_statement_text(e))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            # Not one we write (someone's statement in our table): its JSON, so that it is still named
            # and compared, never a reason to fail.
            parts.append(json.dumps(e, sort_keys=True, separators=(",", ":")))
    if comment:
        parts.append(f'comment "{comment}"')
    return " ".join(parts)


def _statement_text(e: dict[str, Any]) -> str:
    """One statement as ``nft list`` prints it; ``ValueError`` (or a lookup error) for one we never write."""
    if "match" in e:
        return _match_text(e["match"])
    if "mangle" in e:
        key = e["mangle"]["key"]
        return f"{_left_text(key)} set {_value_text(e['mangle']['value'], _hex_of(key))}"
    if "jump" in e:
        return f"jump {e['jump']['target']}"
    if "redirect" in e:
        return f"redirect to :{e['redirect']['port']}"
    if "tproxy" in e:
        fam = e["tproxy"].get("family")
        return f"tproxy {fam + ' ' if fam else ''}to :{e['tproxy']['port']}"
    if len(e) == 1 and next(iter(e.values())) is None and next(iter(e)) in ("accept", "drop", "return"):
        return str(next(iter(e)))
    raise ValueError(f"nft text: no rendering of statement {e!r}")


def _prio_text(hook: str, prio: int) -> str:
    return _NAT_PRIO_NAMES.get((hook, prio)) or _PRIO_NAMES.get(prio) or str(prio)


def base_text(base: dict[str, Any] | None) -> str:
    """A base chain's attributes as ``nft list`` prints them ("regular chain" for the others)."""
    if not base:
        return "regular chain"
    return (f"type {base.get('type')} hook {base.get('hook')} priority {_prio_text(base['hook'], base['prio'])};"
            f" policy {base.get('policy')};")


def ruleset_text(rs: Ruleset) -> str:
    """Our table as ``nft list table inet rdr_redirect`` prints it (the kernel tests compare the
    two): what the JSON batch of ``commands_for`` installs, for a reader. Empty: no table."""
    if not rs:
        return ""
    chains = []
    for name, spec in rs.items():
        lines = [f"\tchain {name} {{"]
        if spec.base:
            lines.append(f"\t\t{base_text(spec.base)}")
        lines += [f"\t\t{expr_text(expr, comment)}" for expr, comment in spec.rules]
        lines.append("\t}")
        chains.append("\n".join(lines))
    return f"table {FAMILY} {TABLE} {{\n" + "\n\n".join(chains) + "\n}\n"


def diff_rulesets(cur: Ruleset, want: Ruleset) -> list[str]:
    diffs = []
    for name in list(want) + [n for n in cur if n not in want]:
        if name not in cur:
            diffs.append(f"missing chain {name} ({base_text(want[name].base)})")
            continue
        if name not in want:
            diffs.append(f"unexpected chain {name} ({base_text(cur[name].base)})")
            continue
        c, w = cur[name], want[name]
        if c.base != w.base:
            diffs.append(f"chain {name}: is {base_text(c.base)}, want {base_text(w.base)}")
        if c.rules != w.rules:
            diffs += list_differences(f"chain {name}", "rule", c.rules, w.rules, lambda r: expr_text(*r))
            if len(c.rules) == len(w.rules) and all(r in c.rules for r in w.rules):
                diffs.append(f"chain {name}: rules are out of order")
    return diffs
