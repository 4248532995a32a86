"""What a pod may do to its own nftables state does not crash, blind or fool us.

A pod (root in its netns) owns what is in it: a table with flags (``flags dormant``, which
libnftables 1.0.6 cannot print as JSON without reading freed memory), our own table or the
iptables-nft tables our rules are in made dormant, objects of its own in the tables iptables-nft
uses, statements we never write in our table. Every operation runs in a subprocess where the
binding could abort the process, so a crash is a failed test, not a dead test run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import redirect
from redirect import RedirectConfig
from tests.netkit import Pod
from tests.test_ownership import full_ruleset, sh

NETFILTER = ["iptables-nft", "iptables-legacy", "nftables"]

RUN = """
import json, sys
import redirect
ns, op, backend = sys.argv[1:4]
try:
    if op == "setup":
        out = {"changed": redirect.setup(ns, redirect.RedirectConfig(), backend=backend).changed}
    elif op == "check":
        r = redirect.check(ns, redirect.RedirectConfig(), backend=backend)
        out = {"ok": r.ok, "differences": list(r.differences)}
    elif op == "show":
        out = {"show": redirect.show(ns, backend=backend)}
    else:
        out = {"removed": redirect.teardown(ns, backend=backend)}
except redirect.SetupError as e:
    out = {"error": str(e)}
print(json.dumps(out, default=str))
"""


def run(ns: str, op: str, backend: str) -> dict:  # type: ignore[type-arg]
    """``op`` (setup, check, show, teardown) of the default config in a process of its own: its answer,
    or a failed test naming how the process died."""
    p = subprocess.run([sys.executable, "-c", RUN, ns, op, backend], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{op} with {backend} died (rc {p.returncode}): {p.stderr[-2000:]}"
    return json.loads(p.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", NETFILTER)
def test_a_dormant_table_of_the_pods_crashes_nothing(pod: Pod, backend: str) -> None:
    """Before the fix every operation listed the tables as JSON, and libnftables printed this one
    from freed memory: a JSON error, or an abort (rc 134)."""
    sh(pod.name, "nft", "add", "table", "inet", "fw", "{ flags dormant; }")
    sh(pod.name, "nft", "add", "table", "ip", "fw2", "{ flags dormant; }")
    sh(pod.name, "nft", "add", "chain", "ip", "fw2", "c")
    before = full_ruleset(pod.name)
    for _ in range(3):  # (the use after free does not show every time)
        assert run(pod.name, "setup", backend) == {"changed": True}
        assert run(pod.name, "check", backend) == {"ok": True, "differences": []}
        assert run(pod.name, "setup", backend) == {"changed": False}
        assert run(pod.name, "show", backend)["show"]["installed"] is True
        assert run(pod.name, "teardown", backend) == {"removed": True}
        after = full_ruleset(pod.name)
        if backend == "iptables-legacy":  # (its tables stay, empty: the kernel cannot remove them)
            after, before = after[after.index("## nft list ruleset"):], before[before.index("## nft list ruleset"):]
        assert after == before


def test_our_table_made_dormant_is_a_difference_that_setup_repairs(pod: Pod) -> None:
    redirect.setup(pod.name, RedirectConfig(), backend="nftables")
    installed = full_ruleset(pod.name)
    sh(pod.name, "nft", "add", "table", "inet", "rdr_redirect", "{ flags dormant; }")
    res = run(pod.name, "check", "nftables")
    assert not res["ok"] and any("dormant" in d for d in res["differences"]), res
    assert run(pod.name, "show", "nftables")["show"]["flags"] == ["dormant"]
    assert run(pod.name, "setup", "nftables") == {"changed": True}
    assert full_ruleset(pod.name) == installed  # the same table, no flags
    assert run(pod.name, "check", "nftables") == {"ok": True, "differences": []}
    sh(pod.name, "nft", "add", "table", "inet", "rdr_redirect", "{ flags dormant; }")
    assert run(pod.name, "teardown", "nftables") == {"removed": True}
    assert "rdr_redirect" not in full_ruleset(pod.name)


@pytest.mark.parametrize("table", ["ip nat", "ip6 nat"])
def test_an_iptables_nft_table_of_ours_made_dormant_is_a_difference_that_setup_repairs(pod: Pod, table: str) -> None:
    redirect.setup(pod.name, RedirectConfig(), backend="iptables-nft")
    installed = full_ruleset(pod.name)
    sh(pod.name, "nft", "add", "table", *table.split(), "{ flags dormant; }")
    res = run(pod.name, "check", "iptables-nft")
    assert not res["ok"] and any(f"table {table} has flags dormant" in d for d in res["differences"]), res
    assert run(pod.name, "setup", "iptables-nft") == {"changed": True}
    assert full_ruleset(pod.name) == installed
    assert run(pod.name, "check", "iptables-nft") == {"ok": True, "differences": []}
    assert run(pod.name, "teardown", "iptables-nft") == {"removed": True}


POD_NAT = """table ip nat {
\tcounter mycounter {
\t}
\tquota myquota {
\t\tover 1 mbytes
\t}
}
table ip6 nat {
\tchain OUTPUT {
\t\ttype nat hook output priority -100; policy accept;
\t}
}
"""


def test_iptables_nft_teardown_keeps_the_pods_own_tables_chains_and_objects(pod: Pod) -> None:
    """iptables-nft puts our jumps in the pod's ``ip nat`` (holding a counter and a quota) and its
    ``ip6 nat`` OUTPUT base chain: teardown deletes only the chains setup made for the jumps
    (marked so), never the pod's chain, objects or tables."""
    sh(pod.name, "nft", "-f", "-", stdin=POD_NAT)
    before = full_ruleset(pod.name)
    redirect.setup(pod.name, RedirectConfig(), backend="iptables-nft")
    redirect.setup(pod.name, RedirectConfig(inbound_interception="TPROXY"), backend="iptables-nft")
    assert redirect.teardown(pod.name, backend="iptables-nft")
    after = full_ruleset(pod.name)
    assert "mycounter" in after and "myquota" in after and "table ip6 nat" in after
    assert after == before


def test_iptables_nft_teardown_still_removes_what_setup_made(pod: Pod) -> None:
    """Of what setup made for our jumps, teardown deletes all that holds nothing else."""
    redirect.setup(pod.name, RedirectConfig(inbound_interception="TPROXY"), backend="iptables-nft")
    assert "made for our iptables-nft jumps" in sh(pod.name, "nft", "list", "ruleset")
    sh(pod.name, "iptables-nft", "-t", "mangle", "-A", "PREROUTING", "-p", "udp", "--dport", "9", "-j", "ACCEPT")
    assert redirect.teardown(pod.name, backend="iptables-nft")
    after = sh(pod.name, "nft", "list", "ruleset")
    # The pod's rule keeps its (our-made) chain and table; all else we made is gone.
    assert "udp dport 9" in after and "table ip nat" not in after and "table ip6" not in after, after


def test_a_statement_we_never_write_in_our_table_is_named_not_a_crash(pod: Pod) -> None:
    """Someone's rule in our chain with a ``counter`` (a statement we never render): check names it
    (its JSON), setup and teardown refuse naming it; once removed, teardown goes ahead."""
    redirect.setup(pod.name, RedirectConfig(), backend="nftables")
    during = full_ruleset(pod.name)
    sh(pod.name, "nft", "add", "rule", "inet", "rdr_redirect", "nat_OUTPUT", "udp", "dport", "9", "counter")
    with_theirs = full_ruleset(pod.name)
    res = run(pod.name, "check", "nftables")
    assert not res["ok"] and any("not ours" in d and "udp dport 9" in d and '"counter"' in d
                                 for d in res["differences"]), res
    assert "not_ours" in run(pod.name, "show", "nftables")["show"]
    for op in ("setup", "teardown"):
        out = run(pod.name, op, "nftables")
        assert "not ours" in out.get("error", "") and "counter" in out["error"], out
        assert full_ruleset(pod.name) == with_theirs
    items = json.loads(sh(pod.name, "nft", "-a", "-j", "list", "chain", "inet", "rdr_redirect", "nat_OUTPUT"))
    (handle,) = [i["rule"]["handle"] for i in items["nftables"] if "rule" in i and "comment" not in i["rule"]]
    sh(pod.name, "nft", "delete", "rule", "inet", "rdr_redirect", "nat_OUTPUT", "handle", str(handle))
    assert full_ruleset(pod.name) == during
    assert run(pod.name, "teardown", "nftables") == {"removed": True}


def test_a_rule_with_our_comment_and_a_statement_we_never_write_is_replaced(pod: Pod) -> None:
    redirect.setup(pod.name, RedirectConfig(), backend="nftables")
    during = full_ruleset(pod.name)
    sh(pod.name, "nft", "add", "rule", "inet", "rdr_redirect", "nat_OUTPUT", "udp", "dport", "9", "counter",
       "comment", '"redirect: forged"')
    res = run(pod.name, "check", "nftables")
    assert not res["ok"] and any("unexpected rule" in d and '"counter"' in d for d in res["differences"]), res
    assert run(pod.name, "setup", "nftables") == {"changed": True}
    assert full_ruleset(pod.name) == during


QUIET = """
import sys
import redirect
ns = sys.argv[1]
assert redirect.setup(ns, redirect.RedirectConfig(), backend="iptables-nft").changed
assert not redirect.setup(ns, redirect.RedirectConfig(), backend="iptables-nft").changed
assert redirect.check(ns, redirect.RedirectConfig(), backend="iptables-nft").ok
assert redirect.teardown(ns, backend="iptables-nft")
"""


def test_iptables_nft_setup_check_and_teardown_write_nothing_to_stderr(pod: Pod) -> None:
    """The tables and chains our iptables-nft rules are in are read from the kernel, not listed
    through libnftables: its text of iptables-nft's rules (ours, and the pod's own beside them)
    made libxtables write warnings ("XT target REDIRECT not found", "Extension owner is not
    supported") to the process's stderr on every setup and check."""
    sh(pod.name, "iptables-nft", "-t", "nat", "-A", "OUTPUT", "-m", "owner", "--uid-owner", "5", "-j", "RETURN")
    before = full_ruleset(pod.name)
    p = subprocess.run([sys.executable, "-c", QUIET, pod.name], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-2000:]
    assert full_ruleset(pod.name) == before
