"""What is ours: only our objects are ever changed, and teardown gives back the ruleset as it was.

Each test fills a pod netns with someone else's rules first (both iptables variants, both
families, an nftables table, objects named like ours), sets capture up, changes the config,
tears it down, and compares the whole ruleset (every table of ``iptables-save`` and
``ip6tables-save`` of both variants, and ``nft list ruleset``) with what it was before: equal
line for line, packet counters and the save tools' timestamp comments aside.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

import redirect
from redirect import RedirectConfig
from redirect.ambient import node
from tests.netkit import Pod

DATA = Path(__file__).parent / "data"
SAVES = ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save")
NETFILTER = ["iptables-nft", "iptables-legacy", "nftables"]
CONFIGS = {
    "default": RedirectConfig(),
    "tproxy-dns-invalid": RedirectConfig(inbound_interception="TPROXY", dns_capture=True, capture_all_dns=True,
                                         drop_invalid=True, outbound_exclude_ports=(22,)),
    "ambient-dns": RedirectConfig(mode="ambient", dns_capture=True),
}


def sh(ns: str, *argv: str, stdin: str | None = None) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], input=stdin, capture_output=True, text=True,
                          check=True).stdout


def full_ruleset(ns: str) -> str:
    """Every table of both iptables variants and families, and the nftables ruleset."""
    out = []
    for tool in SAVES:
        out.append(f"## {tool}")
        out += [re.sub(r"\[\d+:\d+\]", "[0:0]", ln) for ln in sh(ns, tool).splitlines() if not ln.startswith("#")]
    out.append("## nft list ruleset")
    nft = sh(ns, "nft", "list", "ruleset")
    out += [re.sub(r"packets \d+ bytes \d+", "packets 0 bytes 0", ln) for ln in nft.splitlines()]
    return "\n".join(out)


def routing(ns: str) -> str:
    cmds = [["rule"], ["-6", "rule"], ["route", "show", "table", "all"], ["-6", "route", "show", "table", "all"],
            ["-o", "addr"]]
    return "\n".join(subprocess.run(["ip", "-n", ns, *c], capture_output=True, text=True, check=True).stdout
                     for c in cmds)


FOREIGN_XT = """*raw
-A PREROUTING -p udp -m udp --dport 9 -j RETURN
COMMIT
*mangle
-A POSTROUTING -p udp -m udp --dport 9 -j RETURN
COMMIT
*nat
-A POSTROUTING -o lo -j RETURN
COMMIT
*filter
:RDR_MYFW - [0:0]
-A INPUT -j RDR_MYFW
-A RDR_MYFW -p tcp -m tcp --dport 9999 -j DROP
COMMIT
"""

FOREIGN_NFT = """table inet fw {
    chain input {
        type filter hook input priority 0; policy accept;
        tcp dport 9999 drop
    }
}
"""


def add_foreign(ns: str) -> None:
    """Someone else's rules: every table of both variants and families (the legacy tables then
    exist before we come), a filter chain named ``RDR_MYFW`` jumped to from INPUT, an nft table."""
    for tool in ("iptables-nft-restore", "ip6tables-nft-restore", "iptables-legacy-restore",
                 "ip6tables-legacy-restore"):
        sh(ns, tool, "--noflush", stdin=FOREIGN_XT)
    sh(ns, "nft", "-f", "-", stdin=FOREIGN_NFT)


@pytest.mark.parametrize("backend", NETFILTER)
@pytest.mark.parametrize("first", list(CONFIGS))
def test_teardown_gives_back_the_ruleset_byte_for_byte(pod: Pod, backend: str, first: str) -> None:
    add_foreign(pod.name)
    before, routes_before = full_ruleset(pod.name), routing(pod.name)
    second = "default" if first != "default" else "tproxy-dns-invalid"
    redirect.setup(pod.name, CONFIGS[first], backend=backend)
    during = full_ruleset(pod.name)
    assert "RDR_MYFW" in during and "-A INPUT -j RDR_MYFW" in during and "table inet fw" in during
    redirect.setup(pod.name, CONFIGS[second], backend=backend)  # a changed config
    assert redirect.check(pod.name, CONFIGS[second], backend=backend).ok
    assert redirect.teardown(pod.name, backend=backend)
    assert full_ruleset(pod.name) == before
    assert routing(pod.name) == routes_before


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy"])
def test_a_chain_named_like_ours_but_not_ours_is_refused_and_left_alone(pod: Pod, backend: str) -> None:
    variant = backend.split("-")[1]
    sh(pod.name, f"iptables-{variant}-restore", "--noflush",
       stdin="*nat\n:RDR_OUTBOUND - [0:0]\n-A RDR_OUTBOUND -p tcp -m tcp --dport 25 -j RETURN\nCOMMIT\n")
    before = full_ruleset(pod.name)
    with pytest.raises(redirect.SetupError, match="nat chain RDR_OUTBOUND"):
        redirect.setup(pod.name, None, backend=backend)
    assert full_ruleset(pod.name) == before
    res = redirect.check(pod.name, None, backend=backend)
    assert any("not ours" in d and "RDR_OUTBOUND" in d for d in res.differences), res.differences
    assert redirect.teardown(pod.name, backend=backend) is False
    assert full_ruleset(pod.name) == before


def test_an_nftables_table_named_like_ours_but_not_ours_is_refused_and_left_alone(pod: Pod) -> None:
    sh(pod.name, "nft", "-f", "-", stdin="table inet rdr_redirect {\n chain input {\n"
       "  type filter hook input priority 0; policy drop;\n }\n}\n")
    before = full_ruleset(pod.name)
    with pytest.raises(redirect.SetupError, match="inet rdr_redirect .*not ours"):
        redirect.setup(pod.name, None, backend="nftables")
    assert full_ruleset(pod.name) == before
    res = redirect.check(pod.name, None, backend="nftables")
    assert not res.ok and "not ours" in res.differences[0], res.differences
    assert redirect.teardown(pod.name, backend="nftables") is False
    assert full_ruleset(pod.name) == before
    assert redirect.show(pod.name, backend="nftables")["installed"] is False


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy"])
def test_the_node_chain_in_the_same_netns_is_not_the_pods(pod: Pod, backend: str) -> None:
    variant = backend.split("-")[1]
    sh(pod.name, f"iptables-{variant}", "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "RETURN")  # picks it
    try:
        assert node.setup_node(pod.name)
        node_rules = [ln for ln in sh(pod.name, f"iptables-{variant}-save", "-t", "nat").splitlines()
                      if node.CHAIN in ln]
        for cfg in (RedirectConfig(), RedirectConfig(outbound_exclude_ports=(22,))):
            redirect.setup(pod.name, cfg, backend=backend)
            assert node.check_node(pod.name).ok
        redirect.teardown(pod.name, backend=backend)
        assert node.check_node(pod.name).ok
        assert [ln for ln in sh(pod.name, f"iptables-{variant}-save", "-t", "nat").splitlines()
                if node.CHAIN in ln] == node_rules
    finally:
        node.teardown_node(pod.name)


def test_a_node_chain_not_ours_is_refused(pod: Pod) -> None:
    sh(pod.name, "iptables-restore", "--noflush",
       stdin=f"*nat\n:{node.CHAIN} - [0:0]\n-A {node.CHAIN} -j RETURN\nCOMMIT\n")
    before = full_ruleset(pod.name)
    with pytest.raises(redirect.SetupError, match=f"nat chain {node.CHAIN} is not ours"):
        node.setup_node(pod.name, node.NodeConfig(ipv6=False))
    assert not node.check_node(pod.name, node.NodeConfig(ipv6=False)).ok
    node.teardown_node(pod.name)
    assert full_ruleset(pod.name) == before


# --------------------------------------------------------------------------- upgrade


PREVIOUS_IPT = RedirectConfig(inbound_interception="TPROXY", dns_capture=True)
PREVIOUS_NFT = RedirectConfig(mode="ambient", dns_capture=True)


def install_previous(ns: str, backend: str) -> None:
    """What the previous release's setup left (tests/data/README.md), without our comments."""
    if backend == "nftables":
        sh(ns, "nft", "-j", "-f", str(DATA / "previous-nftables.json"))
        return
    variant = backend.split("-")[1]
    for fam, tool in ((4, "iptables"), (6, "ip6tables")):
        # Without the built-in chains' policy lines: restoring those would make iptables-nft create
        # every built-in chain, where the setup made only those it jumped from.
        text = (DATA / f"previous-iptables-v{fam}.save").read_text()
        text = "".join(ln for ln in text.splitlines(keepends=True) if not re.match(r":[A-Z]+ ACCEPT ", ln))
        sh(ns, f"{tool}-{variant}-restore", "--noflush", stdin=text)


@pytest.mark.parametrize("backend", NETFILTER)
def test_rules_of_the_previous_release_are_recognised_and_replaced(pod: Pod, backend: str) -> None:
    add_foreign(pod.name)
    before = full_ruleset(pod.name)
    cfg = PREVIOUS_NFT if backend == "nftables" else PREVIOUS_IPT
    install_previous(pod.name, backend)
    assert redirect.show(pod.name, backend=backend)["installed"]
    assert not redirect.check(pod.name, cfg, backend=backend).ok  # our comments are missing
    assert redirect.setup(pod.name, cfg, backend=backend).changed
    assert redirect.check(pod.name, cfg, backend=backend).ok
    text = full_ruleset(pod.name)
    if backend == "nftables":
        listing = json.loads(sh(pod.name, "nft", "-j", "list", "table", "inet", "rdr_redirect"))["nftables"]
        assert all(i["rule"]["comment"].startswith("redirect") for i in listing if "rule" in i)
    else:
        ours = [ln for ln in text.splitlines() if ln.startswith("-A") and re.search("RDR2?_", ln) and "MYFW" not in ln]
        assert ours and all('--comment "redirect' in ln for ln in ours), ours
    assert redirect.teardown(pod.name, backend=backend)
    assert full_ruleset(pod.name) == before


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy"])
def test_teardown_removes_the_previous_releases_rules(pod: Pod, backend: str) -> None:
    add_foreign(pod.name)
    before = full_ruleset(pod.name)
    install_previous(pod.name, backend)
    assert redirect.teardown(pod.name, backend=backend)
    assert full_ruleset(pod.name) == before


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy"])
@pytest.mark.parametrize("point", ["iptables.before_restore_v4", "iptables.remove_v4", "iptables.remove_v6"])
def test_an_upgrade_killed_midway_keeps_the_previous_rules_whole_until_repaired(
        pod: Pod, backend: str, point: str) -> None:
    from tests.test_kill import killed_setup, our_lines

    add_foreign(pod.name)
    before = full_ruleset(pod.name)
    install_previous(pod.name, backend)
    def ours() -> set[tuple[int, str, str]]:
        return {x for x in our_lines(pod.name, backend) if "RDR_MYFW" not in x[2]}

    previous = ours()
    killed_setup(pod.name, PREVIOUS_IPT, backend, 10.0, point)
    now = ours()
    new = {x for x in now if "RDR2_" in x[2]}
    if point == "iptables.before_restore_v4":  # the new rules half in (IPv6): the previous ones all there
        assert previous <= now and new and not any(x[0] == 4 for x in new)
        # The repair removes the half-added generation first, never the previous whole one.
        killed_setup(pod.name, PREVIOUS_IPT, backend, 10.0, "iptables.remove_v6")
        assert previous <= ours()
    else:  # the new rules all in; the previous ones all there, or IPv4's gone
        assert {x[0] for x in new} == {4, 6}
        assert previous <= now if point == "iptables.remove_v4" else not any(x[0] == 4 for x in now - new)
    res = redirect.check(pod.name, PREVIOUS_IPT, backend=backend)
    assert res.differences[0].startswith("interrupted setup"), res.differences
    assert redirect.setup(pod.name, PREVIOUS_IPT, backend=backend).changed
    assert redirect.check(pod.name, PREVIOUS_IPT, backend=backend).ok
    assert not any("RDR_" in x[2] for x in ours())  # only the new generation
    assert redirect.teardown(pod.name, backend=backend)
    assert full_ruleset(pod.name) == before
