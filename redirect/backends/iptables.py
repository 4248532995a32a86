"""The iptables backend: ``iptables-restore --noflush`` payloads of our chains only.

What is ours. Our chains have exact names: a generation prefix (``RDR_`` or ``RDR2_``) and
one of the plan's chain names (``POD_CHAINS``); every rule of ours, and each jump from a
built-in chain into ours, carries the comment ``redirect: <purpose>``. A chain with one of
our names that holds no rule of ours and that no rule of ours jumps to is someone else's:
setup refuses, naming it, and nothing touches it. A rule without our comment in a chain of
ours, or one jumping into ours that is not our jump, is someone else's inside ours: setup and
teardown refuse, naming it, and change nothing. Other ``RDR_*`` chains (the node's
``RDR_NODE_POSTRT``, a firewall's ``RDR_MYFW``) are never looked at. Rules are rendered in
exactly the form ``iptables-save`` prints them, so what is installed is read back and compared
line by line (``check``), and a setup whose rules are already in place changes nothing. The
previous release's layout (bare ``-A OUTPUT -j RDR_OUTPUT`` and ``-A PREROUTING -j
RDR_PREROUTING`` jumps in raw, mangle or nat, and our chains reached from them, each rule
exactly as we render it but with the purpose as its whole comment) is recognised as ours,
and the next setup replaces it (``iptables_rules.parse_save``).

Order of a change (see ``IptablesBackend``): the new config goes in under the other
generation's names beside the old one, then the old one is removed, IPv4's nat table marking
the moment each generation is whole. ``iptables-restore`` commits table by table, so that is
the unit of atomicity; a failure while adding is rolled back, and a setup killed anywhere
leaves a state that the next setup finishes or undoes.

Teardown gives the ruleset back as it was: with iptables-nft, the built-in chains (nft base
chains) and tables that setup made for our jumps (``iptables_nft.make_builtin_chains``, marked with a
comment) are deleted with them when nothing else is in them; the pod's own stay. A legacy
xtables table that did not exist before setup stays, empty: the kernel has no way to remove
one from a namespace.

The variant (legacy xtables or nf_tables) is chosen per namespace: whichever one
already holds rules there wins; with neither, the host's ``iptables`` alternative. Ours in the
other variant (the choice changed: forced, or legacy tables appeared) is read with the chosen
one: setup removes it once the new capture is in, ``check`` reports it.

The rules' text (rendering a plan, reading a dump) is ``redirect.backends.iptables_rules``, the
nf_tables side of iptables-nft (its tables and built-in chains) ``redirect.backends.iptables_nft``;
this module runs the tools and orders the changes.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import Any

from ..errors import BackendUnavailable, SetupError
from ..kernel import routes as rt
from ..plan import netfilter_plan
from ..plan.intent import AnyIntent
from .base import MARK, CheckResult, Installed, fault_point
from .iptables_nft import (
    Hooked,
    clear_flags,
    drop_empty_xtables_nft,
    flagged_xtables,
    make_builtin_chains,
    nft_call,
    nft_chains_of_ours,
    nft_xtables_present,
    xtables_tables,
)
from .iptables_rules import (
    GENERATIONS,
    VARIANTS,
    Found,
    State,
    TableState,
    Unreadable,
    add_payload,
    anchor,
    desired_state,
    diff_state,
    parse_save,
    payload_for,
    remove_payload,
)

log = logging.getLogger("redirect.iptables")

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
    if nft_xtables_present(unknown=False):  # (without the binding: the host's alternative decides)
        return "nft"
    # Nothing here yet: follow the host's alternative.
    target = os.path.realpath(shutil.which("iptables") or "/usr/sbin/iptables")
    return "legacy" if "legacy" in os.path.basename(target) else "nft"


def _hooked(fam: int, state: State) -> Hooked:
    return {(fam, table, j.split()[1]) for table, ts in state.items() for j in ts.jumps}


Read = dict[int, Found]  # family -> what the dump holds


def _gen_present(cur: Read, g: int) -> bool:
    return any(f.gens[g] for f in cur.values())


def _complete(cur: Read, g: int) -> bool:
    """Generation ``g`` holds its anchor: its setup finished adding it and no removal began (the
    previous release's bare jump counts for generation 0: it wrote each family in one go)."""
    jumps = cur[4].gens[g].get("nat", TableState()).jumps
    return anchor(GENERATIONS[g]) in jumps or (g == 0 and f"-A OUTPUT -j {GENERATIONS[0]}OUTPUT" in jumps)


def _refuse_intruders(name: str, what: str, cur: Read) -> None:
    """``SetupError`` naming the rules not ours that are in or jump into chains of ours: ours can't
    be replaced or removed without touching them, and they are never touched."""
    intruders = [x for f in cur.values() for x in f.intruders]
    if intruders:
        raise SetupError(
            f"{name}: rules that are not ours (no comment {MARK!r}) are in or jump into chains of ours: "
            f"{'; '.join(intruders)}. {what} refused, nothing changed: they are never touched; remove them, then"
            f" run {what} again"
        )


class IptablesBackend:
    """Renders plans with ``iptables-restore``; ``variant`` forces legacy or nft.

    Steps of a changed config (each ``iptables-restore`` commits table by table), every one
    of which leaves the namespace capturing at least what one of the two configs captures:

    1. routes and addresses the new config needs are added (``redirect.kernel.routes``);
    2. the new rules go in under the free generation's chain names, beside the old ones, their
       jumps appended after the old ones: IPv6 first, then IPv4 with the nat table last, whose
       jump into ``<gen>OUTPUT`` is the generation's anchor (present = complete);
    3. the old generation is removed: IPv4 first with its nat table (its anchor) first, then IPv6;
       then ours in the other variant, if any (the variant chosen here changed);
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

    def render(self, it: AnyIntent, families: tuple[int, ...]) -> str:
        plan = netfilter_plan(it)
        out = []
        for fam in families:
            out.append(f"# IPv{fam}: {'iptables' if fam == 4 else 'ip6tables'}-restore --noflush")
            out.append(payload_for(desired_state(plan, fam)).rstrip())
        return "\n".join(out) + "\n"

    def read(self, variant: str) -> Read:
        """What of ours each family holds, from ``*tables-save``; a family without any table of
        that variant (a fresh pod) is read as empty without exec'ing the save."""
        have = self._families_with_tables(variant)
        return {fam: self._parse(variant, fam) if fam in have else Found() for fam in (4, 6)}

    def _parse(self, variant: str, fam: int) -> Found:
        """``parse_save`` of the family's dump; ``SetupError`` naming the netns when it can't be read
        safely (a rule there could hide a jump into ours: nothing is changed or reported as fine)."""
        try:
            return parse_save(self.save(variant, fam), fam)
        except Unreadable as e:
            from ..kernel.netns import current_name

            raise SetupError(
                f"{self.name}: netns {current_name()!r}: the {'ip' if fam == 4 else 'ip6'}tables-{variant}-save"
                f" dump cannot be read safely: {e}. Setup and teardown refuse and check reports it, nothing changed"
            ) from None

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
        tables = nft_call(xtables_tables, None)
        if tables is None:
            return {4, 6}
        return {4 if family == "ip" else 6 for family, _ in tables}

    def _remove_gen(self, variant: str, cur: Read, g: int, hooked: Hooked) -> None:
        """Remove generation ``g``: IPv4 (nat, its anchor, first), then IPv6."""
        for fam in (4, 6):
            state = cur[fam].gens[g]
            if state:
                fault_point(f"iptables.remove_v{fam}")
                self.restore(variant, fam, remove_payload(state))
                hooked |= _hooked(fam, state)
                cur[fam].gens = (({}, cur[fam].gens[1]) if g == 0 else (cur[fam].gens[0], {}))

    def apply(self, it: AnyIntent, families: tuple[int, ...]) -> Installed:
        plan = netfilter_plan(it)
        variant = self._variant()
        cur = self.read(variant)
        # Ours in the other variant (the choice changed since: legacy tables appeared, or the
        # variant is forced now) goes once the new capture is in: read (and refused) now.
        others = self._others(variant)
        foreign = [x for f in cur.values() for x in f.foreign]
        if foreign:
            raise SetupError(
                f"{self.name}: named like ours but not ours (no rule carries our comment {MARK!r}), so left alone"
                f" and setup refused: {'; '.join(foreign)}. Rename or remove them (a chain of ours emptied by a"
                " flush looks like this too: delete it with -X)"
            )
        for c in (cur, *others.values()):
            _refuse_intruders(self.name, "setup", c)
        want = {g: {fam: desired_state(plan, fam, g) if fam in families else {} for fam in (4, 6)} for g in (0, 1)}

        def same(g: int) -> bool:
            return all(cur[fam].gens[g] == want[g][fam] for fam in (4, 6))

        present = [g for g in (0, 1) if _gen_present(cur, g)]
        keep = next((g for g in present if same(g)), None)
        txn = rt.txn_for(it, families)
        # iptables-nft tables of ours made dormant run none of our chains: setup un-dormants them.
        flagged = flagged_xtables({(f, t) for f in families for t in want[0][f]}) if variant == "nft" else []
        if keep is not None and len(present) == 1 and not txn.changed and not flagged and not others:
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
                if variant == "nft":
                    make_builtin_chains(set().union(*(_hooked(f, want[target][f]) for f in (6, 4))))
                for fam in (6, 4):  # IPv4 last: its nat table holds the anchor
                    fault_point(f"iptables.before_restore_v{fam}")
                    self.restore(variant, fam, add_payload(want[target][fam]))
                step = "remove"
                if old is not None:
                    self._remove_gen(variant, cur, old, hooked)
            step = "remove"
            for other, ocur in others.items():
                log.info("%s: removing our capture in iptables-%s now that iptables-%s holds it", self.name, other,
                         variant)
                self._remove_all(other, ocur)
            step = "finish"
            clear_flags(flagged)
            fault_point("iptables.before_routes_finish")
            txn.finish()
        except BaseException as e:
            self._rollback(variant, e, step, target, hooked, txn)
            raise
        finally:
            if variant == "nft":
                drop_empty_xtables_nft(hooked)
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
                    self.restore(variant, fam, remove_payload(added))
                    hooked |= _hooked(fam, added)
            except Exception as re_:  # pragma: no cover - reported, not hidden
                log.error("rollback of IPv%d failed: %s", fam, re_)
        try:
            txn.rollback()
        except Exception as re_:  # pragma: no cover
            log.error("rollback of routes failed: %s", re_)
        if isinstance(e, Exception) and not isinstance(e, (SetupError, BackendUnavailable)):
            raise SetupError(f"setup failed and was rolled back: {e}") from e

    def _remove_all(self, variant: str, cur: Read) -> bool:
        """Remove every generation of ours ``cur`` (read from ``variant``) holds; True if any."""
        hooked: Hooked = set()
        changed = False
        try:
            for g in (0, 1):
                if cur and _gen_present(cur, g):
                    self._remove_gen(variant, cur, g, hooked)
                    changed = True
        finally:
            if variant == "nft":
                drop_empty_xtables_nft(hooked)
        return changed

    def _others(self, variant: str) -> dict[str, Read]:
        """What of ours the variants other than ``variant`` hold, those that hold any."""
        return {v: cur for v, cur in self._read_all(skip=variant).items()
                if cur and any(_gen_present(cur, g) for g in (0, 1))}

    def _read_all(self, skip: str | None = None) -> dict[str, Read]:
        """What each variant (but ``skip``) holds of ours (a variant without tables of ours is not read)."""
        out: dict[str, Read] = {}
        for variant in VARIANTS:
            if variant == skip:
                continue
            present = self._has_variant_state(variant) if variant == "legacy" else nft_chains_of_ours()
            try:
                out[variant] = self.read(variant) if present else {}
            except BackendUnavailable:
                continue
        return out

    def foreign_in_ours(self) -> list[str]:
        """Rules not ours inside or jumping into chains of ours, in either variant (``remove``
        refuses then)."""
        return [x for cur in self._read_all().values() for f in cur.values() for x in f.intruders]

    def remove(self, keep_routes: bool = False) -> bool:
        changed = False
        reads = self._read_all()
        for cur in reads.values():  # before anything is removed: all or nothing
            _refuse_intruders(self.name, "teardown", cur)
        for variant, cur in reads.items():
            changed = self._remove_all(variant, cur) or changed
            for f in cur.values():
                for x in f.foreign:
                    log.warning("%s: left alone, named like ours but not ours: %s", self.name, x)
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
        return nft_xtables_present(unknown=True)  # (without the binding: the dump decides)

    def installed(self) -> bool:
        """Whether any chain of ours exists (cheap: no exec unless tables with our names exist)."""
        if nft_chains_of_ours() and any(_gen_present(self.read("nft"), g) for g in (0, 1)):
            return True
        return self._has_variant_state("legacy") and any(_gen_present(self.read("legacy"), g) for g in (0, 1))

    def check(self, it: AnyIntent, families: tuple[int, ...]) -> CheckResult:
        plan = netfilter_plan(it)
        variant = self._variant()
        diffs: list[str] = []
        try:
            cur = self.read(variant)
            others = self._others(variant)
        except SetupError as e:  # (fail closed: what can't be read is a difference)
            return CheckResult(False, self.name, (str(e),))
        for f in cur.values():
            diffs += [f"not ours, named like ours: {x}" for x in f.foreign]
            diffs += [f"not ours, in ours (setup and teardown refuse until it is removed): {x}" for x in f.intruders]
        present = [g for g in (0, 1) if _gen_present(cur, g)]
        if len(present) == 2:
            diffs.append(f"interrupted setup: two generations of our chains are installed ({GENERATIONS[0]}* and"
                         f" {GENERATIONS[1]}*); run setup again")
        for other, ocur in others.items():
            where = sorted({f"IPv{fam} {t}" for fam, f in ocur.items() for st in f.gens for t in st})
            diffs.append(f"capture of ours in iptables-{other} too ({', '.join(where)}), beside iptables-{variant}"
                         " (the variant chosen here changed since it was set up; setup removes it)")
            diffs += [f"not ours, in ours (setup and teardown refuse until it is removed): {x}"
                      for f in ocur.values() for x in f.intruders]
        g = next((g for g in present if _complete(cur, g)), present[0] if present else 0)
        for fam in (4, 6):
            want = desired_state(plan, fam, g) if fam in families else {}
            diffs += diff_state(fam, cur[fam].gens[g], want)
            if variant == "nft":
                diffs += [f"table {nfam} {t} has flags {','.join(fl)}" + (" (dormant: none of its chains runs, ours"
                          " capture nothing)" if "dormant" in fl else "")
                          for nfam, t, fl in flagged_xtables({(fam, t) for t in want})]
        diffs += rt.differences(it, families)
        return CheckResult(not diffs, self.name, tuple(diffs))

    def show(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name, "variants": {}}
        for variant in VARIANTS:
            if not self._has_variant_state(variant):
                continue
            cur = self.read(variant)
            shown = {}
            for f in cur.values():
                if f.foreign or f.intruders:
                    out.setdefault("not_ours", []).extend(f.foreign + f.intruders)
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

