"""The iptables backend's side of nf_tables (iptables-nft): the tables and built-in chains our jumps
go in, read from the kernel or through libnftables in-process, never by exec.

Which iptables-nft tables and chains of our names a netns has (``xtables_tables``,
``nft_chains_of_ours``); the built-in chains (nft base chains) and tables setup makes for our
jumps, marked with ``MADE_FOR_JUMPS`` (``make_builtin_chains``), and teardown deletes again only
when nothing else is in them (``drop_empty_xtables_nft``); the flags of a table our rules are in
(``flagged_xtables``: a dormant one runs none of our chains), which setup clears
(``clear_flags``). ``redirect.backends.iptables`` orders these with its ``iptables-restore``
payloads.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import SetupError
from .iptables_rules import gen_of

log = logging.getLogger("redirect.iptables")

XT_TABLES = ("raw", "mangle", "nat", "filter")
_T = TypeVar("_T")


def nft_call(what: Callable[[Any], _T], default: _T) -> _T:
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


def xtables_tables(nft: Any) -> list[tuple[str, str]]:
    """The (family, name) of the iptables-nft tables here."""
    from .nftables import table_names

    try:
        names = table_names(nft)
    except SetupError:
        return []
    return [(f, n) for f, n in names if f in ("ip", "ip6") and n in XT_TABLES]


def nft_xtables_present(unknown: bool) -> bool:
    """Whether iptables-nft has a table here; ``unknown`` without the libnftables binding to list with."""
    return nft_call(lambda nft: bool(xtables_tables(nft)), unknown)


def nft_chains_of_ours() -> bool:
    """Whether iptables-nft holds a chain with one of our names here (in-process listings, no
    exec; just the table list when there is no iptables-nft table, as in a pod of the nftables
    backend). Whether it is truly ours is decided on the ``iptables-save`` dump (``parse_save``);
    without the libnftables binding to list with, that dump is always read."""
    from .nftables import list_json

    def look(nft: Any) -> bool:
        for family in sorted({f for f, _ in xtables_tables(nft)}):
            try:
                items = list_json(nft, [{"list": {"chains": {"family": family}}}])
            except SetupError:
                return True  # (unreadable: the dump decides)
            for item in items:
                c = item.get("chain")
                if isinstance(c, dict) and c.get("table") in XT_TABLES and gen_of(str(c.get("name", ""))) is not None:
                    return True
        return False

    return nft_call(look, True)


Hooked = set[tuple[int, str, str]]  # (family, table, built-in chain) we removed a jump of ours from

#: The comment on the iptables-nft tables and built-in chains (nft base chains) setup makes for our
#: jumps (``make_builtin_chains``): teardown deletes only such, and only when nothing else is in them.
MADE_FOR_JUMPS = "redirect: made for our iptables-nft jumps"


def _nfam(fam: int) -> str:
    return "ip" if fam == 4 else "ip6"


def make_builtin_chains(hooks: Hooked) -> None:
    """Before iptables-nft adds our jumps: make each built-in chain in ``hooks`` (and its table)
    that does not exist yet, as iptables-nft would (the same type, hook and priority, policy
    accept), carrying ``MADE_FOR_JUMPS``. Teardown then knows which it may delete
    (``drop_empty_xtables_nft``): a pod's own nat table or base chain looks just the same
    otherwise. If this fails (someone made one meanwhile) iptables-nft makes what is missing, and
    teardown leaves that."""
    from .nftables import forget_tables, list_json, table_names
    from .nftables_rules import BASE_CHAINS

    def make(nft: Any) -> None:
        tables = set(table_names(nft))
        have = set()
        for nfam in sorted({_nfam(f) for f, _, _ in hooks if any(t[0] == _nfam(f) for t in tables)}):
            for i in list_json(nft, [{"list": {"chains": {"family": nfam}}}]):
                c = i.get("chain")
                if isinstance(c, dict):
                    have.add((c.get("family"), c.get("table"), c.get("name")))
        cmds = [f'create table {_nfam(f)} {t} {{ comment "{MADE_FOR_JUMPS}"; }}'
                for f, t in sorted({(f, t) for f, t, _ in hooks}) if (_nfam(f), t) not in tables]
        for f, t, chain in sorted(hooks):
            spec = BASE_CHAINS.get((t, chain.lower()))
            if spec is None or (_nfam(f), t, chain) in have:
                continue
            cmds.append(f'create chain {_nfam(f)} {t} {chain} {{ comment "{MADE_FOR_JUMPS}"; type {spec[0]} hook'
                        f" {chain.lower()} priority {spec[1]}; policy accept; }}")
        if cmds:
            forget_tables()
            rc, _, err = nft.cmd("\n".join(cmds))
            if rc != 0:
                log.info("iptables-nft makes the built-in chains for our jumps (ours were refused: %s)",
                         str(err).strip())

    try:
        nft_call(make, None)
    except SetupError as e:
        log.info("iptables-nft makes the built-in chains for our jumps (%s)", e)


#: nf_tables' table flags (NFT_TABLE_F_*) by name, as nft prints them.
_TABLE_FLAGS = ((1, "dormant"), (2, "owner"), (4, "persist"))
_NF_ACCEPT = 1
_NFT_CHAIN_BASE = 1


def _nft_obj(fam: int, table: str, chain: str | None = None) -> Any:
    """The kernel's description of the nf_tables table ``table`` of family ``fam`` (4, 6), or of its
    chain ``chain``, read over netlink (``rdr_nft_table``, ``rdr_nft_chain``: flags, use count,
    policy, whether a chain holds a rule, the comment); None when there is none. Not listed
    through libnftables: the text of a table or chain holding iptables-nft's rules makes
    libxtables write warnings to the process's stderr, and JSON that prints a table object is
    unsafe (``nftables.list_text``). ``SetupError`` if it can't be read."""
    from ..native import load

    if "\0" in table or (chain is not None and "\0" in chain):
        return None  # (no nf_tables name holds one)
    n = load()
    out = n.ffi.new("struct rdr_nft_obj *")
    if chain is None:
        ret = n.lib.rdr_nft_table(fam, table.encode(), out)
    else:
        ret = n.lib.rdr_nft_chain(fam, table.encode(), chain.encode(), out)
    if ret == -errno.ENOENT:
        return None
    if ret < 0:
        what = f"table {_nfam(fam)} {table}" + ("" if chain is None else f" chain {chain}")
        raise SetupError(f"could not read {what} from nf_tables: {os.strerror(-ret)}")
    return out


def _comment(o: Any) -> bytes | None:
    """The comment on ``o`` (``_nft_obj``), or None."""
    from ..native import load

    return None if o.comment_len < 0 else bytes(load().ffi.string(o.comment))


def _flag_names(flags: int) -> tuple[str, ...]:
    names = [name for bit, name in _TABLE_FLAGS if flags & bit]
    rest = flags & ~sum(bit for bit, _ in _TABLE_FLAGS)
    return tuple(names + ([hex(rest)] if rest else []))


def _made_for_jumps_only(o: Any, chain: bool) -> bool:
    """Whether the table or chain ``o`` (``_nft_obj``) holds nothing but our ``MADE_FOR_JUMPS``
    comment: a table without flags and nothing in it (no chain, set, object, flowtable: its use
    count 0); a chain that is a base chain with an accept policy, no other flag, no rule. An
    attribute the kernel did not send counts against it."""
    if _comment(o) != MADE_FOR_JUMPS.encode():
        return False
    if not chain:
        return bool(o.flags == 0 and o.use == 0)
    return bool(o.hook and o.policy == _NF_ACCEPT and o.flags in (-1, _NFT_CHAIN_BASE) and not o.rules)


def drop_empty_xtables_nft(hooked: Hooked) -> None:
    """Undo what setup made for our jumps alone (``make_builtin_chains``): a built-in chain in
    ``hooked`` that carries ``MADE_FOR_JUMPS`` and holds nothing else (no rule: the kernel also
    refuses to delete a chain that has one) is deleted, then its table if that carries the
    comment and holds nothing else, as if we had never come (``nft list ruleset`` as before
    setup). A chain or table without it existed before (the pod's, or made by iptables-nft for a
    release before this one) and stays. Read from the kernel (``_nft_obj``), not listed."""
    from .nftables import forget_tables

    def drop(nft: Any) -> None:
        for fam, table, chain in sorted(hooked):
            try:
                o = _nft_obj(fam, table, chain)
            except SetupError:
                continue
            if o is not None and _made_for_jumps_only(o, chain=True):
                nft.cmd(f"delete chain {_nfam(fam)} {table} {chain}")
        for fam, table in sorted({(f, t) for f, t, _ in hooked}):
            try:
                o = _nft_obj(fam, table)
            except SetupError:
                continue
            if o is not None and _made_for_jumps_only(o, chain=False):
                nft.cmd(f"delete table {_nfam(fam)} {table}")
        forget_tables()

    if hooked:
        nft_call(drop, None)


def flagged_xtables(tables: set[tuple[int, str]]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(family, table, flags) of each iptables-nft table in ``tables`` ((family, name): those our
    rules are in) that has flags: a dormant table runs none of its chains, so ours capture nothing.
    Read from the kernel (``_nft_obj``), not listed."""
    out = []
    for fam, t in sorted(tables):
        o = _nft_obj(fam, t)
        if o is not None and o.flags > 0:
            out.append((_nfam(fam), t, _flag_names(int(o.flags))))
    return out


def clear_flags(flagged: list[tuple[str, str, tuple[str, ...]]]) -> None:
    """Un-dormant the tables ``flagged_xtables`` named (an ``add table`` from the JSON API sets no flags)."""
    from .nftables import run_commands

    if flagged:
        cmds = [{"add": {"table": {"family": f, "name": t}}} for f, t, _ in flagged]
        nft_call(lambda nft: run_commands(nft, cmds), None)



__all__ = ["XT_TABLES", "Hooked", "MADE_FOR_JUMPS", "nft_call", "xtables_tables", "nft_xtables_present",
           "nft_chains_of_ours", "make_builtin_chains", "drop_empty_xtables_nft", "flagged_xtables", "clear_flags"]
