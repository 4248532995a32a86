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
import sys
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


def without_empty_builtin_chains(ruleset: str) -> str:
    """``full_ruleset`` without empty base chains named like iptables' built-in ones. The previous
    release's setup let iptables-nft make those for its jumps, unmarked; teardown now deletes only
    those setup made and marked (nothing tells the others from a pod's own), so they stay, empty."""
    text = re.sub(r"\n\tchain (PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) \{\n\t\ttype [^\n]*\n\t\}(?=\n)", "",
                  ruleset)
    return re.sub(r"\n\n+", "\n", text)


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
    assert without_empty_builtin_chains(full_ruleset(pod.name)) == without_empty_builtin_chains(before)


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy"])
def test_teardown_removes_the_previous_releases_rules(pod: Pod, backend: str) -> None:
    add_foreign(pod.name)
    before = full_ruleset(pod.name)
    install_previous(pod.name, backend)
    assert redirect.teardown(pod.name, backend=backend)
    assert without_empty_builtin_chains(full_ruleset(pod.name)) == without_empty_builtin_chains(before)


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
    assert without_empty_builtin_chains(full_ruleset(pod.name)) == without_empty_builtin_chains(before)


# --------------------------------------------------------------------------- look-alikes of the previous release


@pytest.mark.noroot
def test_the_previous_releases_rules_are_exactly_ours_unmarked_and_nothing_else() -> None:
    """What the previous-release recognition accepts, rule by rule: a rule our renderer writes,
    with the purpose as its whole comment (every rule of every golden file, so unmarked); not
    the same rule marked, without a comment, with another target or an extra match."""
    from redirect.backends.iptables_rules import _previous_release_rule

    lines = 0
    for path in sorted((Path(__file__).parent / "golden").glob("*.iptables.golden")):
        fam = 4
        for ln in path.read_text().splitlines():
            fam = 6 if ln.startswith("# IPv6") else 4 if ln.startswith("# IPv4") else fam
            if ln.startswith("-A RDR_"):
                unmarked = re.sub(r'"redirect: ([^"]*)"', r'"\1"', ln)
                assert _previous_release_rule(unmarked, fam), (path.name, unmarked)
                assert not _previous_release_rule(ln, fam), ln  # ours now: marked
                lines += 1
    assert lines > 500
    for near in ['-A RDR_OUTBOUND -p tcp -j RETURN',  # no comment
                 '-A RDR_PREROUTING -p tcp -m tcp --dport 80 -m comment --comment web'
                 ' -j DNAT --to-destination 192.0.2.9',
                 '-A RDR_OUTBOUND -m comment --comment loopback -j RETURN --extra',
                 '-A RDR_OUTBOUND -m comment --comment loopback -j MYCHAIN',
                 '-A RDR_OUTBOUND -m comment --comment loopback -m comment --comment again -j RETURN',
                 '-A RDR_OUTBOUND -p sctp -m comment --comment loopback -j RETURN',
                 '-A RDR_OUTBOUND -m limit --limit 3/min -m comment --comment loopback -j RETURN']:
        assert not _previous_release_rule(near, 4), near


@pytest.mark.noroot
def test_reading_a_huge_dump_is_linear() -> None:
    """60,000 chains of someone's and 20,000 rules of the previous release's form jumping on (a pod
    controls its netns: any number) are read in linear time; each rule's target was looked up in
    the list of every declared chain (6.8 s here, under the netns lock; now about 0.5 s)."""
    import time

    from redirect.backends.iptables_rules import parse_save

    rules = [f'-A RDR_OUTPUT -p tcp -m tcp --dport {i % 65535 + 1} -m comment --comment "x" -j RDR_OUTBOUND'
             for i in range(20000)]
    dump = "\n".join(["*nat", *(f":F{i} - [0:0]" for i in range(60000)), ":OUTPUT ACCEPT [0:0]",
                      ":RDR_OUTPUT - [0:0]", ":RDR_OUTBOUND - [0:0]", "-A OUTPUT -j RDR_OUTPUT", *rules,
                      '-A RDR_OUTBOUND -m comment --comment "y" -j RETURN', "COMMIT", ""])
    t0 = time.perf_counter()
    found = parse_save(dump)
    took = time.perf_counter() - t0
    assert len(found.gens[0]["nat"].chains["RDR_OUTPUT"]) == 20000  # (the previous release's, recognised)
    assert took < 3.0, took


LOOK_ALIKES = {
    # someone's port forward in a chain named like the previous release's, reached by a bare jump
    "dnat": "*nat\n:RDR_PREROUTING - [0:0]\n-A PREROUTING -j RDR_PREROUTING\n"
            "-A RDR_PREROUTING -p tcp -m tcp --dport 80 -j DNAT --to-destination 192.0.2.1:8080\nCOMMIT\n",
    # a rule of the previous release's form beside one of theirs: all or nothing
    "mixed": "*nat\n:RDR_OUTPUT - [0:0]\n-A OUTPUT -j RDR_OUTPUT\n"
             "-A RDR_OUTPUT -d 127.0.0.1/32 -m comment --comment loopback -j RETURN\n"
             "-A RDR_OUTPUT -p tcp -m tcp --dport 25 -j RETURN\nCOMMIT\n",
    # nothing but empty chains behind bare jumps
    "empty": "*mangle\n:RDR_OUTPUT - [0:0]\n:RDR_PREROUTING - [0:0]\n-A OUTPUT -j RDR_OUTPUT\n"
             "-A PREROUTING -j RDR_PREROUTING\nCOMMIT\n",
}


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy"])
@pytest.mark.parametrize("form", list(LOOK_ALIKES))
def test_a_foreign_chain_named_like_the_previous_releases_is_never_taken_for_ours(
        pod: Pod, backend: str, form: str) -> None:
    """Named exactly like ours, jumped to bare as the previous release did, but not what it
    wrote: ``show`` does not call it ours, ``teardown`` and a backend switch leave it, ``setup``
    refuses naming it (our chain would need its name)."""
    variant = backend.split("-")[1]
    sh(pod.name, f"iptables-{variant}-restore", "--noflush", stdin=LOOK_ALIKES[form])
    before = full_ruleset(pod.name)
    chain = re.search(r":(RDR_\w+)", LOOK_ALIKES[form]).group(1)  # type: ignore[union-attr]
    assert redirect.show(pod.name, backend=backend)["installed"] is False
    assert redirect.show(pod.name)["installed"] is False
    assert redirect.teardown(pod.name, backend=backend) is False
    assert redirect.teardown(pod.name) is False
    assert full_ruleset(pod.name) == before
    with pytest.raises(redirect.SetupError, match=f"chain {chain}"):
        redirect.setup(pod.name, None, backend=backend)
    assert full_ruleset(pod.name) == before
    res = redirect.check(pod.name, None, backend=backend)
    assert any("not ours" in d and chain in d for d in res.differences), res.differences
    # A switch to nftables: ours goes in; theirs, not being ours, is not "the old capture".
    assert redirect.setup(pod.name, None, backend="nftables").changed
    assert redirect.show(pod.name)["backends"] == ["nftables"]
    assert redirect.teardown(pod.name)
    assert full_ruleset(pod.name) == before


# --------------------------------------------------------------------------- theirs inside ours


INTRUDERS = {  # (what is added after our setup, how it is named in the refusal)
    "iptables-nft": [(["iptables-nft", "-t", "nat", "-I", "RDR_OUTBOUND", "-p", "tcp", "--dport", "25", "-j", "RETURN"],
                      "-A RDR_OUTBOUND -p tcp -m tcp --dport 25 -j RETURN"),
                     (["iptables-nft", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-j", "RDR_OUTBOUND"],
                      "-A OUTPUT -p udp -j RDR_OUTBOUND")],
    "iptables-legacy": [(["iptables-legacy", "-t", "nat", "-I", "RDR_OUTBOUND", "-p", "tcp", "--dport", "25", "-j",
                          "RETURN"], "-A RDR_OUTBOUND -p tcp -m tcp --dport 25 -j RETURN"),
                        (["iptables-legacy", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-j", "RDR_OUTBOUND"],
                         "-A OUTPUT -p udp -j RDR_OUTBOUND")],
    "nftables": [(["nft", "insert", "rule", "inet", "rdr_redirect", "nat_OUTBOUND", "tcp", "dport", "25", "return"],
                  "rule in chain nat_OUTBOUND: tcp dport 25 return"),
                 (["nft", "add", "chain", "inet", "rdr_redirect", "myfw"], "chain 'myfw'")],
}


@pytest.mark.parametrize("backend", NETFILTER)
@pytest.mark.parametrize("which", [0, 1], ids=["rule-in-ours", "other"])
def test_what_is_not_ours_inside_ours_is_named_and_never_removed(pod: Pod, backend: str, which: int) -> None:
    """Someone's rule in one of our chains (or jumping into one, or their chain in our nftables
    table): ``check`` names it, ``setup`` (a changed config, a backend switch) and ``teardown``
    refuse naming it and change nothing, ``show`` still shows ours installed; once it is gone,
    teardown gives the ruleset back as it was."""
    add_foreign(pod.name)
    before = full_ruleset(pod.name)
    redirect.setup(pod.name, CONFIGS["default"], backend=backend)
    argv, named = INTRUDERS[backend][which]
    sh(pod.name, *argv)
    during = full_ruleset(pod.name)
    res = redirect.check(pod.name, CONFIGS["default"], backend=backend)
    assert not res.ok and any(named in d and "not ours" in d for d in res.differences), res.differences
    assert redirect.show(pod.name)["installed"] and redirect.show(pod.name, backend=backend)["installed"]
    other = "nftables" if backend != "nftables" else "iptables-nft"
    for attempt in (lambda: redirect.setup(pod.name, CONFIGS["tproxy-dns-invalid"], backend=backend),
                    lambda: redirect.setup(pod.name, CONFIGS["default"], backend=other),
                    lambda: redirect.teardown(pod.name, backend=backend),
                    lambda: redirect.teardown(pod.name)):
        with pytest.raises(redirect.SetupError, match="not ours") as e:
            attempt()
        assert named in str(e.value), e.value
        assert full_ruleset(pod.name) == during
    p = subprocess.run([sys.executable, "-m", "redirect.cli", "teardown", pod.name], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and named in p.stderr and "nothing of ours" not in p.stdout, (p.stdout, p.stderr)
    assert full_ruleset(pod.name) == during
    undo(pod.name, argv)
    assert redirect.teardown(pod.name)
    assert full_ruleset(pod.name) == before


def undo(ns: str, argv: list[str]) -> None:
    """Take out what ``argv`` (of ``INTRUDERS``) added."""
    if argv[:2] == ["nft", "add"]:
        sh(ns, "nft", "delete", *argv[2:])
    elif argv[0] == "nft":  # the rule without a comment in that chain, by its handle
        items = json.loads(sh(ns, "nft", "-a", "-j", "list", "chain", "inet", "rdr_redirect", argv[5]))["nftables"]
        (handle,) = [i["rule"]["handle"] for i in items if "rule" in i and "comment" not in i["rule"]]
        sh(ns, "nft", "delete", "rule", "inet", "rdr_redirect", argv[5], "handle", str(handle))
    else:
        sh(ns, *[a if a not in ("-I", "-A") else "-D" for a in argv])


@pytest.mark.parametrize("backend", ["ebpf", "nftables"])
def test_a_policy_rule_like_ours_but_not_ours_outlives_setup_and_teardown(pod: Pod, backend: str,
                                                                         request: pytest.FixtureRequest) -> None:
    """Someone's rule with our ambient rule's selector, priority and table (Istio's own in-pod rule)
    stays through our setup and teardown: a delete names our routing protocol, so the kernel
    never takes theirs for ours."""
    if backend == "ebpf":
        request.getfixturevalue("ebpf_root")
    theirs = ("fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100")
    for fam in ("-4", "-6"):
        sh(pod.name, "ip", fam, "rule", "add", *theirs)

    def rules() -> str:
        return sh(pod.name, "ip", "-4", "rule", "show") + sh(pod.name, "ip", "-6", "rule", "show")

    before = rules()
    redirect.setup(pod.name, RedirectConfig(mode="ambient"), backend=backend)
    try:
        assert rules().count("proto 201") == 2  # ours, besides theirs
    finally:
        redirect.teardown(pod.name)
    assert rules() == before


HIDDEN_JUMPS = {  # id: (backend, config, rule added after setup (iptables args), how a refusal names it)
    "goto": ("iptables-nft", "default", ["-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "9", "-g", "RDR_OUTPUT"],
             "-A OUTPUT -p udp -m udp --dport 9 -g RDR_OUTPUT"),
    "comment-with-j": ("iptables-legacy", "tproxy-dns-invalid",
                       ["-t", "mangle", "-A", "PREROUTING", "-m", "comment", "--comment", "see -j ACCEPT", "-j",
                        "RDR_DIVERT"], '-A PREROUTING -m comment --comment "see -j ACCEPT" -j RDR_DIVERT'),
    "newline-in-comment": ("iptables-nft", "default",
                           ["-t", "nat", "-A", "OUTPUT", "-m", "comment", "--comment", "x\ny", "-j", "RDR_OUTPUT"],
                           "cannot be read safely"),
}


@pytest.mark.parametrize("form", list(HIDDEN_JUMPS))
def test_a_jump_into_ours_however_written_is_seen(pod: Pod, form: str) -> None:
    """A rule of someone's jumping into ours with ``-g``, after a comment that mentions ``-j X``, or
    with a newline in its comment (which ``iptables-save`` does not escape: that dump is refused
    as unreadable): ``check`` names it, a changed setup and teardown refuse and change nothing (no
    half-removed capture), and once it is gone teardown gives the ruleset back."""
    backend, config, args, named = HIDDEN_JUMPS[form]
    tool = backend  # iptables-nft / iptables-legacy
    add_foreign(pod.name)
    before = full_ruleset(pod.name)
    redirect.setup(pod.name, CONFIGS[config], backend=backend)
    sh(pod.name, tool, *args)
    try:
        during = full_ruleset(pod.name)
        res = redirect.check(pod.name, CONFIGS[config], backend=backend)
        assert not res.ok and any(named in d for d in res.differences), res.differences
        other = "default" if config != "default" else "tproxy-dns-invalid"
        for attempt in (lambda: redirect.setup(pod.name, CONFIGS[other], backend=backend),
                        lambda: redirect.teardown(pod.name, backend=backend),
                        lambda: redirect.teardown(pod.name)):
            with pytest.raises(redirect.SetupError) as e:
                attempt()
            assert named in str(e.value), e.value
            if named == "cannot be read safely":  # (the netns named as the caller named it)
                assert f"netns {pod.name!r}" in str(e.value), e.value
            assert full_ruleset(pod.name) == during
        # Refused again, not half-done: the same setup is still a no-op.
        res = redirect.check(pod.name, CONFIGS[config], backend=backend)
        assert not any("interrupted" in d for d in res.differences), res.differences
    finally:
        sh(pod.name, tool, *["-D" if a == "-A" else a for a in args])
    assert redirect.check(pod.name, CONFIGS[config], backend=backend).ok
    assert redirect.teardown(pod.name)
    assert full_ruleset(pod.name) == before


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy"])
def test_a_comment_that_mentions_our_chain_is_no_jump(pod: Pod, backend: str) -> None:
    """Someone's rule whose comment says ``-j RDR_OUTPUT`` (quoted: one token) jumps nowhere of
    ours: not an intruder; setup, a change and teardown go ahead and leave it."""
    rule = ["-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "9", "-m", "comment", "--comment",
            "like -j RDR_OUTPUT does", "-j", "RETURN"]
    add_foreign(pod.name)  # (every legacy table exists before: the kernel can't remove one)
    sh(pod.name, backend, *rule)
    before = full_ruleset(pod.name)
    redirect.setup(pod.name, CONFIGS["default"], backend=backend)
    assert redirect.check(pod.name, CONFIGS["default"], backend=backend).ok
    redirect.setup(pod.name, CONFIGS["tproxy-dns-invalid"], backend=backend)
    assert redirect.check(pod.name, CONFIGS["tproxy-dns-invalid"], backend=backend).ok
    assert redirect.teardown(pod.name)
    assert full_ruleset(pod.name) == before


@pytest.mark.parametrize("how", ["incompatible table", "incompatible base chain"])
def test_a_table_iptables_nft_cannot_show_is_refused_not_taken_for_empty(pod: Pod, how: str) -> None:
    """Rules nft made in iptables-nft's nat table that iptables-nft-save cannot print (it prints
    ``# Table `nat' is incompatible`` instead, exit 0): what that table holds is unseen, ours
    included. ``check`` reports it, a changed setup and teardown refuse naming the table and the
    nftables backend, nothing changes (no second generation beside ours, no report of nothing
    installed, the netfilter mark kept)."""
    from redirect.kernel import netns as rnetns
    from redirect.kernel.locks import netfilter_mark

    redirect.setup(pod.name, CONFIGS["default"], backend="iptables-nft")
    if how == "incompatible table":
        nft = ["add chain ip nat mine", "add rule ip nat mine fib daddr type local counter"]
        undo_nft = ["delete chain ip nat mine"]
    else:
        nft = ["add chain ip nat mine { type nat hook output priority -99; }",
               "add rule ip nat mine fib daddr type local counter"]
        undo_nft = ["flush chain ip nat mine", "delete chain ip nat mine"]
    for c in nft:
        sh(pod.name, "nft", c)
    try:
        assert "incompatible" in sh(pod.name, "iptables-nft-save")
        during = full_ruleset(pod.name)
        res = redirect.check(pod.name, CONFIGS["default"], backend="iptables-nft")
        assert not res.ok and any("table nat" in d for d in res.differences), res.differences
        for attempt in (lambda: redirect.setup(pod.name, CONFIGS["tproxy-dns-invalid"], backend="iptables-nft"),
                        lambda: redirect.teardown(pod.name, backend="iptables-nft"),
                        lambda: redirect.teardown(pod.name)):
            with pytest.raises(redirect.SetupError) as e:
                attempt()
            assert "table nat" in str(e.value) and "nftables" in str(e.value), e.value
            assert full_ruleset(pod.name) == during
        assert netfilter_mark(rnetns.netns_inode(pod.name)) != 0
    finally:
        for c in undo_nft:
            sh(pod.name, "nft", c)
    assert redirect.check(pod.name, CONFIGS["default"], backend="iptables-nft").ok
    assert redirect.teardown(pod.name) and not redirect.show(pod.name)["installed"]


@pytest.mark.parametrize("backend", ["iptables-nft", "nftables"])
def test_a_route_of_anothers_like_ours_serves_ours_and_another_default_is_refused(pod: Pod, backend: str) -> None:
    """``local default dev lo table 133`` of someone's (istio-iptables leaves it) is what our TPROXY
    policy route needs: setup adds only our rule, ``check`` is satisfied, the same setup again
    changes nothing, and teardown removes our rule and leaves their route. Another default route
    in that table (which would make ours route nowhere) fails setup naming it, nothing changed."""
    cfg = CONFIGS["tproxy-dns-invalid"]
    for fam in ("-4", "-6"):
        sh(pod.name, "ip", fam, "route", "add", "local", "default", "dev", "lo", "table", "133")
    before = routing(pod.name)
    try:
        assert redirect.setup(pod.name, cfg, backend=backend).changed
        res = redirect.check(pod.name, cfg, backend=backend)
        assert res.ok, res.differences
        assert not redirect.setup(pod.name, cfg, backend=backend).changed
        assert "lookup 133 proto 201" in sh(pod.name, "ip", "rule")
    finally:
        redirect.teardown(pod.name)
    assert routing(pod.name) == before

    for fam in ("-4", "-6"):
        sh(pod.name, "ip", fam, "route", "del", "local", "default", "dev", "lo", "table", "133")
        sh(pod.name, "ip", fam, "route", "add", "unreachable", "default", "table", "133")
    before, rules_before = routing(pod.name), full_ruleset(pod.name)
    with pytest.raises(redirect.SetupError, match="table 133 already holds a default route"):
        redirect.setup(pod.name, cfg, backend=backend)
    assert routing(pod.name) == before and full_ruleset(pod.name) == rules_before
