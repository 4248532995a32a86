"""The nftables backend: one libnftables JSON transaction over one table of ours.

Layout. Everything lives in one table, ``inet rdr_redirect``; nothing else is ever
read for writing or touched. A table of that name is ours if a rule in it carries our
comment ``redirect: <purpose>``, or if it is the previous release's: nothing but chains named
as below, base chains exactly where ``BASE_CHAINS`` puts them with an accept policy, and rules
with plain comments. Anything else (someone's firewall of that name) is refused by setup,
naming it, and never changed or deleted (``not_ours``). In a table of ours, a chain, rule or
other object that is not ours (``_split``) makes setup and teardown refuse, naming it
(``ForeignInOurs``): ours cannot be replaced or deleted without it.

Each plan chain ``(table, NAME)`` becomes the chain ``<table>_<NAME>`` in our table
(``nat_OUTBOUND``, ``mangle_DIVERT``...). A plan chain with a hook becomes a base chain at
the priority (and of the type) of the iptables table it stands for, so our chains run
exactly where iptables' would:

=======  ==============  ============  ========
table    hook            nft type      priority
=======  ==============  ============  ========
raw      prerouting/out  filter        -300
mangle   prerouting      filter        -150
mangle   output          route         -150 (a mark change re-routes, as iptables' mangle OUTPUT)
nat      prerouting/out  nat           -100
=======  ==============  ============  ========

Families. The table is ``inet``: a rule without a family matches IPv4 and IPv6; a
rule of one family carries ``ip``/``ip6`` address matches (which imply the family)
or ``meta nfproto ipv4/ipv6``. When a family is not wanted (``families=(4,)``: the
iptables backend then installs no IPv6 rules at all) every base chain starts with
``meta nfproto ipv6 return``, so IPv6 is left exactly as uncaptured as there. (One
side effect remains: an inet nat chain turns on conntrack for IPv6 too, so IPv6
connections are tracked, though never NATed, where iptables would not track them.)

Verdicts, compared with the iptables backend (where our chains hang off the
built-in chains with one appended ``-j RDR_*`` jump):

- ``Return`` in a chain we jump to goes back to the caller, as in iptables; in a
  base chain it ends our chain (policy accept), and the packet goes on to the other
  rules of that hook, as in iptables where it goes on to the rules after our jump.
- ``Accept`` ends our base chain; the packet still meets *other* tables' chains on
  the same hook (e.g. the iptables ``mangle`` table, or someone's nft table). In
  iptables an ``ACCEPT`` in ``RDR_*`` also skips foreign rules appended *after* our
  jump in the same built-in chain. So for our own rules the behaviour is identical;
  the difference is only what foreign rules that come after ours in the same
  iptables table get to see. (For NAT both are the same: the first NAT binding of a
  connection wins, and an accept without NAT lets the next nat chain run, for
  iptables' nat tables and nft nat chains alike.)
- ``Drop`` is final in both.
- ``TProxy``: iptables' TPROXY target drops a packet for which no transparent
  socket is found; nft's ``tproxy`` statement just does not match. We render it as
  ``<matches> tproxy to :P meta mark set M accept`` followed by ``<matches> drop``,
  which is the same.
- Negated owner matches differ for packets without a full socket with a file
  (iptables' ``! --uid-owner`` matches them, nft's ``meta skuid !=`` does not). Such
  packets do not start connections on the output path, so nat never sees them new.
- ``SaveMark``/``RestoreMark`` with a partial mask need an OR of two registers,
  which nft 1.0.6 cannot express: such a plan raises ``BackendUnavailable``.

Transactions. ``apply`` reads our table back (``read_table``: its flags and other objects from
the text listing, its chains and rules as JSON; never a JSON listing of a table, which
libnftables 1.0.6 writes from freed memory for a table with a flag) and compares it with the
rendered plan: equal, without flags, means nothing changes (``Installed.changed=False``). Otherwise
one batch ``add table; delete table; add table; add chains; add rules`` replaces
it (a fresh pod's is ``create table; add chains; add rules``: a table the pod made since the
read fails it, and is neither flushed nor merged with ours): the kernel commits the batch at
once, so no packet sees a half-filled table or no table. Routes and addresses come from
``redirect.kernel.routes`` as for iptables, added before the batch and rolled back if it
fails; those only the old config needed are removed after it. A setup killed in between
leaves one config's table whole with the routes of both: ``check`` reports them, the next
setup removes them.

Mixed hosts. A namespace holding our iptables chains that is set up
with ``backend="nftables"`` (or the reverse) first gets the new backend's rules,
then the old backend's rules are removed (``api.setup`` does this, keeping our
routes which both backends share). Capture never lapses; while both are present
they do the same thing, and a connection is NATed once (the first nat chain that
binds it wins).

Contexts. A libnftables context acts on the netns it was *created* in (FACTS.md),
so every method creates its own, inside the netns the caller entered; none is kept.

The table's JSON (rendering a plan, reading a listing, readable differences) is
``redirect.backends.nftables_rules``; this module runs libnftables and orders the changes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable, SetupError
from ..kernel import netns as _netns
from ..kernel import routes as rt
from ..plan import netfilter_plan
from ..plan.intent import AnyIntent
from ..plan.vocabulary import (
    Plan,
)
from .base import POD_CHAINS, CheckResult, Installed, fault_point, is_owned_comment
from .nftables_rules import (
    BASE_CHAINS,
    FAMILY,
    TABLE,
    Ruleset,
    base_text,
    cached_ruleset,
    commands_for,
    desired_ruleset,
    diff_rulesets,
    expr_text,
    parse_listing,
    parse_table_names,
    parse_table_text,
    ruleset_text,
)

log = logging.getLogger("redirect.nftables")

# --- execution -------------------------------------------------------------------------


def _new_context() -> Any:
    """A libnftables context of its own for the calling thread's netns (create it here, use it here)."""
    try:
        import nftables  # type: ignore[import-not-found]
    except ImportError:
        raise BackendUnavailable(
            "backend=nftables: the libnftables Python binding is missing; install Debian's"
            " 'python3-nftables' (apt-get install python3-nftables) and use a venv with system site packages"
        ) from None
    nft = nftables.Nftables()
    nft.set_json_output(True)
    return nft


_scope = threading.local()


@contextlib.contextmanager
def one_context() -> Iterator[None]:
    """Within this (on one thread, which stays in one netns), ``_context()`` hands out a single
    context, released when the block ends: a setup that lists and applies with the nftables
    backend and then looks for iptables-nft chains of ours creates one context, not two."""
    if getattr(_scope, "active", False):
        yield
        return
    _scope.active, _scope.nft, _scope.tables = True, None, None
    try:
        yield
    finally:
        nft, _scope.active, _scope.nft, _scope.tables = _scope.nft, False, None, None
        if nft is not None:
            _reaper.put(nft)


def _context() -> Any:
    """A libnftables context (JSON output) for the calling thread's netns: the block's shared one
    inside ``one_context()``, else a new one. Give it back with ``release``."""
    if not getattr(_scope, "active", False):
        return _new_context()
    if _scope.nft is None:
        _scope.nft = _new_context()
    return _scope.nft


def context_or_none() -> Any:
    """``_context()``, or None when the libnftables binding is missing."""
    try:
        return _context()
    except BackendUnavailable:
        return None


class _Reaper:
    """Frees used contexts off the caller's path.

    Closing the netlink socket of a context whose batch deleted objects waits for
    the kernel's deferred destruction (an RCU grace period), so
    a setup that freed its context itself would spend most of its time there. The
    context is handed to this thread instead; until it is freed its socket keeps
    the netns alive, which is harmless.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _main(self) -> None:
        while True:
            _free_now(self._q.get())

    def put(self, ctx: Any) -> None:
        with self._lock:
            if self._thread is None:  # (the first caller is often inside a pod's netns: the
                # thread must not stay there, or it keeps that netns alive for good)
                self._thread = _netns.start_thread(self._main, "redirect-nft-reaper")
        self._q.put(ctx)


_reaper = _Reaper()


def release(nft: Any) -> None:
    """Done with a context: it is freed on the reaper thread (a shared one when its
    ``one_context()`` block ends). Every context goes there, not only those whose batch deleted
    objects: the kernel serializes the releases, so freeing even a list-only context here would
    wait for the slow one the reaper is freeing."""
    if getattr(_scope, "active", False) and nft is _scope.nft:
        return
    _reaper.put(nft)


def _free_now(nft: Any) -> None:
    """``nft_ctx_free`` on this thread, whoever holds the last reference (ctypes drops the GIL)."""
    handle = getattr(nft, "_Nftables__ctx", None)
    free = nft.__dict__.get("nft_ctx_free")
    if handle is None or free is None:  # another binding layout: its __del__ frees it
        return
    nft.nft_ctx_free = lambda _ctx: None  # the object's __del__ must not free it again
    nft._Nftables__ctx = None
    free(handle)


@functools.lru_cache(maxsize=256)
def _batch(plan: Plan, families: tuple[int, ...], fresh: bool) -> str:
    """``commands_for`` our table for ``plan`` as the JSON text libnftables parses (built once)."""
    return json.dumps({"nftables": commands_for(cached_ruleset(plan, families), fresh=fresh)})


def table_names(nft: Any) -> list[tuple[str, str]]:
    """(family, name) of every table in this netns, of any family (iptables-nft's too).

    Listed as text (``list_text``): a table with flags would break a JSON listing. Inside
    ``one_context()`` listed once until something changes tables (``forget_tables``): a setup asks
    whether the other netfilter backend has tables here, then lists its own.
    """
    shared = getattr(_scope, "active", False) and nft is _scope.nft
    if shared and _scope.tables is not None:
        return list(_scope.tables)
    try:
        names = parse_table_names(list_text(nft, "list tables"))
    except ValueError as e:
        raise SetupError(f"libnftables listed the tables of this namespace in a form not understood: {e}") from None
    if shared:
        _scope.tables = tuple(names)
    return names


def list_text(nft: Any, cmd: str) -> str:
    """What ``cmd`` (a list command) prints as text.

    Whatever prints a table object (``list tables``, ``list table``, ``list ruleset``) is listed as
    text, never as JSON: libnftables 1.0.6 writes the JSON of a table with one flag (``flags
    dormant``, which a pod may set on any table) from freed memory (``"flags": "Lester Gooch #5"``,
    invalid JSON, or a heap corruption that aborts the process). Listings of chains and rules
    (``list_json``) print no table object and stay JSON.
    """
    nft.set_json_output(False)
    try:
        rc, out, err = nft.cmd(cmd)
    finally:
        nft.set_json_output(True)
    if rc != 0:
        raise SetupError(f"libnftables could not {cmd}: {str(err).strip()}")
    return str(out)


def list_json(nft: Any, cmds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items of the JSON listings ``cmds`` print (libnftables prints one document per list
    command), none of which may print a table object (see ``list_text``). ``SetupError`` if it
    refuses or prints what is not such JSON."""
    rc, out, err = nft.cmd(json.dumps({"nftables": cmds}))
    if rc != 0:
        raise SetupError(f"libnftables could not list {cmds!r}: {str(err).strip()}")
    items: list[dict[str, Any]] = []
    dec, text, pos = json.JSONDecoder(), str(out), 0
    try:
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos >= len(text):
                return items
            doc, pos = dec.raw_decode(text, pos)
            got = doc.get("nftables") if isinstance(doc, dict) else None
            if not isinstance(got, list) or not all(isinstance(i, dict) for i in got):
                raise ValueError("not a list of objects under 'nftables'")
            items += got
    except ValueError as e:
        raise SetupError(f"libnftables printed a listing that is not the JSON expected ({e})") from None


def forget_tables() -> None:
    """Tables may have changed (a batch ran, iptables-nft was exec'd): ``table_names`` lists again."""
    _scope.tables = None


def _run_batch(nft: Any, batch: str) -> None:
    """A batch that lists nothing back: the JSON text straight to ``nft_run_cmd_from_buffer``."""
    forget_tables()
    rc, _, err = nft.cmd(batch)
    if rc != 0:
        raise SetupError(f"libnftables refused the transaction: {err.strip()}")


def run_commands(nft: Any, cmds: list[dict[str, Any]]) -> None:
    """A batch of commands that list nothing back (its output is not parsed)."""
    _run_batch(nft, json.dumps({"nftables": cmds}))


def _chain_not_ours(c: dict[str, Any]) -> str | None:
    """Why chain ``c`` (a listing's chain object) is not of our layout, or None: ours is named
    ``<raw|mangle|nat>_<pod chain>``, and a base chain of ours is exactly where ``BASE_CHAINS``
    puts it, with an accept policy."""
    table, _, name = str(c.get("name", "")).partition("_")
    if table not in ("raw", "mangle", "nat") or name not in POD_CHAINS:
        return f"chain {c.get('name')!r}"
    if "hook" in c:
        typ, prio = BASE_CHAINS.get((table, c["hook"]), (None, None))
        if (c.get("type"), c.get("prio"), c.get("policy")) != (typ, prio, "accept"):
            return (f"base chain {c['name']!r} (type {c.get('type')} hook {c['hook']} priority {c.get('prio')}"
                    f" policy {c.get('policy')})")
    return None


def _layout_not_ours(items: list[dict[str, Any]]) -> list[str]:
    """What in the table listed as ``items`` is not of our layout (each named, for a message):
    objects other than chains and rules, chains not of ours (``_chain_not_ours``)."""
    out = [f"{k} {i[k].get('name', '')!r}" if isinstance(i[k], dict) else k for i in items for k in i
           if k not in ("metainfo", "table", "chain", "rule")]
    return out + [why for i in items if "chain" in i and (why := _chain_not_ours(i["chain"])) is not None]


def _owned(rule: dict[str, Any]) -> bool:
    return is_owned_comment(str(rule.get("comment", "")))


def not_ours(items: list[dict[str, Any]]) -> str | None:
    """Why the table listed as ``items`` is not ours at all, or None if it is.

    Ours: a rule in it carries our comment (``redirect: <purpose>``); what else it holds is
    someone else's inside ours (``_split``). A table without a rule of ours is ours
    only in the layout earlier versions wrote: nothing but chains named
    ``<raw|mangle|nat>_<pod chain>``, base chains exactly where ``BASE_CHAINS`` puts them with an
    accept policy, and rules each with a plain comment (the previous release's purposes), or no
    rules at all (a flushed table of ours). Anything else (someone's firewall of that name) is
    not ours.
    """
    rules = [i["rule"] for i in items if "rule" in i]
    if any(_owned(r) for r in rules):
        return None
    layout = _layout_not_ours(items)
    if layout:
        return f"it holds {', '.join(layout)}"
    if not any("chain" in i for i in items):
        return "it has no chain"
    plain = [r for r in rules if not r.get("comment")]
    if plain:
        return f"its rule {expr_text(plain[0].get('expr', []))!r} in chain {plain[0].get('chain')} has no comment"
    return None


def _split(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """A table of ours (one with a rule of ours) split into its objects of ours (a listing) and
    what is not ours in it, each named: objects other than chains and rules, chains not of our
    layout (with their rules), rules without our comment. The previous release's table (no rule
    of ours; ``not_ours`` said it is ours) is all ours."""
    rules = [i["rule"] for i in items if "rule" in i]
    if not any(_owned(r) for r in rules):
        return items, []
    theirs = {str(i["chain"].get("name")) for i in items if "chain" in i and _chain_not_ours(i["chain"]) is not None}
    ours = [i for i in items if ("chain" in i and i["chain"].get("name") not in theirs)
            or ("rule" in i and i["rule"].get("chain") not in theirs and _owned(i["rule"]))]
    foreign = _layout_not_ours(items) + [
        f"rule in chain {r.get('chain')}: {expr_text(r.get('expr', []), str(r.get('comment', '')))}"
        for r in rules if not _owned(r) and r.get("chain") not in theirs]
    return ours, foreign


class NotOurs(SetupError):
    """A table named like ours that is not ours: never changed or deleted."""


class ForeignInOurs(SetupError):
    """Our table holds objects that are not ours: ours is not changed or removed (theirs would go
    with it); ``table`` is ours in it, ``foreign`` names theirs."""

    def __init__(self, msg: str, table: Table, foreign: list[str]) -> None:
        super().__init__(msg)
        self.table = table
        self.foreign = foreign


@dataclass
class Table:
    """Our table as read: its rules, and its flags (``dormant``: none of its chains runs), which we
    never set, so any is a difference that setup repairs by replacing the table."""

    rules: Ruleset
    flags: tuple[str, ...] = ()


def flag_differences(flags: tuple[str, ...]) -> list[str]:
    return [f"table {FAMILY} {TABLE} has flags {','.join(flags)}, ours has none"
            + (" (dormant: nothing of it runs, nothing is captured)" if "dormant" in flags else "")] if flags else []


def _listing(nft: Any) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """Our table's flags, and its objects as the items of a JSON listing (``not_ours``, ``_split``,
    ``parse_listing`` read them): chains and rules from JSON listings of chains (no table object in
    them), its other objects (sets, counters, a comment ...) from the text listing of the table."""
    flags, others = parse_table_text(list_text(nft, f"list table {FAMILY} {TABLE}"))
    chains = [i for i in list_json(nft, [{"list": {"chains": {"family": FAMILY}}}])
              if isinstance(i.get("chain"), dict) and i["chain"].get("table") == TABLE]
    rules = []
    for c in chains:  # one listing a call: libnftables 1.0.6 fills its cache for a batch's first only
        chain = {"family": FAMILY, "table": TABLE, "name": c["chain"].get("name")}
        rules += [i for i in list_json(nft, [{"list": {"chain": chain}}])
                  if isinstance(i.get("rule"), dict) and i["rule"].get("table") == TABLE]
    return flags, others + chains + rules


def read_table(nft: Any, what: str = "setup") -> Table | None:
    """Our table as installed, or None when there is none; ``NotOurs`` if a table of our name is
    someone else's; ``ForeignInOurs`` (naming them, ``what`` refused) if ours holds anything not ours."""
    if (FAMILY, TABLE) not in table_names(nft):
        return None
    flags, items = _listing(nft)
    why = not_ours(items)
    if why is not None:
        raise NotOurs(f"table {FAMILY} {TABLE} exists and is not ours ({why}): it is left alone and setup refused;"
                      " rename or delete it")
    ours, foreign = _split(items)
    if foreign:
        raise ForeignInOurs(f"table {FAMILY} {TABLE} is ours but holds what is not ours: {'; '.join(foreign)}."
                            f" {what} refused, nothing changed: they are never touched; remove them, then run"
                            f" {what} again", Table(parse_listing(ours), flags), foreign)
    return Table(parse_listing(items), flags)


#: Test-only: commands appended to every setup batch (e.g. an invalid rule, to make it fail).
_EXTRA_COMMANDS_FOR_TESTS: list[dict[str, Any]] = []

_probe_result: tuple[bool, str] | None = None


def probe() -> tuple[bool, str]:
    """Whether libnftables imports and the kernel accepts an inet nat table (cached per process).

    Checked with a dry run (the kernel validates the batch, then aborts it), in the
    netns of the calling thread; nothing is installed.
    """
    global _probe_result
    if _probe_result is None:
        try:
            nft = _new_context()  # its own: dry run must not reach a shared context
            nft.set_dry_run(True)
            t = {"family": FAMILY, "name": TABLE + "_probe"}
            rc, _, err = nft.json_cmd({"nftables": [
                {"add": {"table": t}},
                {"add": {"chain": {**{"family": FAMILY, "table": t["name"]}, "name": "p", "type": "nat",
                                   "hook": "output", "prio": -100, "policy": "accept"}}},
            ]})
            _probe_result = (True, "") if rc == 0 else (False, f"the kernel refused an inet nat chain: {err.strip()}")
        except BackendUnavailable as e:
            _probe_result = (False, str(e))
        except OSError as e:
            _probe_result = (False, f"libnftables could not be loaded: {e}")
    return _probe_result


class NftablesBackend:
    """Renders plans into ``table inet rdr_redirect`` with one libnftables transaction."""

    name = "nftables"

    # All methods act on the calling thread's netns (the caller entered it).

    def render(self, it: AnyIntent, families: tuple[int, ...]) -> str:
        """Our table for ``it`` as ``nft list table inet rdr_redirect`` prints it once installed
        (``apply`` sends the same rules as one libnftables JSON batch)."""
        return ruleset_text(desired_ruleset(netfilter_plan(it), families))

    def apply(self, it: AnyIntent, families: tuple[int, ...]) -> Installed:
        plan = netfilter_plan(it)
        desired = cached_ruleset(plan, families)  # render errors before touching anything
        nft = _context()
        try:
            return self._apply(nft, desired, it, plan, families)
        finally:
            release(nft)

    def _apply(self, nft: Any, desired: Ruleset, it: AnyIntent, plan: Plan, families: tuple[int, ...]) -> Installed:
        read = read_table(nft)
        current = read.rules if read is not None else None
        txn = rt.txn_for(it, families)  # the same routes and addresses as the iptables backend
        # (A table with flags, dormant, is replaced by one without: the batch deletes it.)
        same = read is not None and not read.flags and not diff_rulesets(read.rules, desired)
        detail = {"table": f"{FAMILY} {TABLE}", "chains": list(desired)}
        if same and not txn.changed and not _EXTRA_COMMANDS_FOR_TESTS:
            return Installed(self.name, "", families, False, detail)
        try:
            txn.apply()
            fault_point("nftables.before_transaction")
            if _EXTRA_COMMANDS_FOR_TESTS:
                run_commands(nft, commands_for(desired, fresh=current is None) + list(_EXTRA_COMMANDS_FOR_TESTS))
            elif not same:
                _run_batch(nft, _batch(plan, families, current is None))
            fault_point("nftables.after_transaction")
            txn.finish()
        except BaseException as e:
            log.warning("setup failed (%s); rolling back", e)
            try:
                now = read_table(nft)
                if (now is not None or read is not None) and (
                        diff_rulesets(now.rules if now else {}, current or {})
                        or (now.flags if now else ()) != (read.flags if read else ())):
                    run_commands(nft, commands_for(current or {}))
                    if read is not None and "dormant" in read.flags:  # (the JSON API takes no table flags)
                        _run_batch(nft, f"add table {FAMILY} {TABLE} {{ flags dormant; }}")
            except NotOurs:
                pass  # (someone made a table of our name meanwhile: our batch was refused, nothing to undo)
            except Exception as re:  # pragma: no cover - reported, not hidden
                log.error("rollback of table %s failed: %s", TABLE, re)
            try:
                txn.rollback()
            except Exception as re:  # pragma: no cover
                log.error("rollback of routes failed: %s", re)
            if isinstance(e, (SetupError, BackendUnavailable)):
                raise
            if isinstance(e, Exception):
                raise SetupError(f"setup failed and was rolled back: {e}") from e
            raise
        return Installed(self.name, "", families, True, detail)

    def remove(self, keep_routes: bool = False) -> bool:
        """Delete our table (and, unless ``keep_routes``, our routes); True if anything was there."""
        nft = _context()
        changed = False
        try:
            if read_table(nft, "teardown") is not None:  # (ForeignInOurs: refused, nothing changed)
                run_commands(nft, commands_for({}))
                changed = True
        except NotOurs as e:
            log.warning("%s", e)
        finally:
            release(nft)
        if keep_routes:
            return changed
        return rt.remove_all_ours() or changed

    def installed(self) -> bool:
        try:
            nft = _context()
        except BackendUnavailable:
            return False
        try:
            return read_table(nft) is not None
        except NotOurs:
            return False
        except ForeignInOurs:
            return True
        finally:
            release(nft)

    def foreign_in_ours(self) -> list[str]:
        """What in our table is not ours (``remove`` refuses then)."""
        nft = _context()
        try:
            read_table(nft)
        except NotOurs:
            pass
        except ForeignInOurs as e:
            return e.foreign
        finally:
            release(nft)
        return []

    def check(self, it: AnyIntent, families: tuple[int, ...]) -> CheckResult:
        desired = cached_ruleset(netfilter_plan(it), families)
        nft = _context()
        foreign: list[str] = []
        try:
            current = read_table(nft)
        except NotOurs as e:
            return CheckResult(False, self.name, (str(e),) + tuple(rt.differences(it, families)))
        except ForeignInOurs as e:
            current = e.table
            foreign = [f"not ours, in our table (setup and teardown refuse until it is removed): {x}"
                       for x in e.foreign]
        finally:
            release(nft)
        if current is None:
            diffs = [f"table {FAMILY} {TABLE} is not installed"]
        else:
            diffs = foreign + flag_differences(current.flags) + diff_rulesets(current.rules, desired)
        diffs += rt.differences(it, families)
        return CheckResult(not diffs, self.name, tuple(diffs))

    def show(self) -> dict[str, Any]:
        nft = _context()
        foreign: str | list[str] | None = None
        try:
            current = read_table(nft)
        except NotOurs as e:
            current, foreign = None, str(e)
        except ForeignInOurs as e:
            current, foreign = e.table, e.foreign
        finally:
            release(nft)
        out: dict[str, Any] = {"backend": self.name, "table": f"{FAMILY} {TABLE}", "installed": current is not None}
        if foreign:
            out["not_ours"] = foreign
        if current is not None and current.flags:
            out["flags"] = list(current.flags)
        out["chains"] = {
            name: {"base": base_text(spec.base), "rules": [expr_text(*r) for r in spec.rules]}
            for name, spec in (current.rules if current is not None else {}).items()
        }
        out.update(rt.describe_ours())
        return out

