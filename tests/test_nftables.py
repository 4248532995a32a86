"""The nftables backend: rendering (no root), and real traffic in namespaces.

Every integration test installs our table in a fresh pod netns, sends traffic with
the netkit probes and asserts which listener it reached and with which original
destination.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import redirect
from redirect.backends import nftables as nb
from redirect.backends import nftables_rules as nr
from redirect.config import RedirectConfig
from redirect.errors import BackendUnavailable, SetupError
from redirect.plan import build_plan
from redirect.plan.intent import intent_for
from redirect.plan.vocabulary import Chain, Plan, Rule, SaveMark
from tests.netkit import Pod, TcpListener, UdpListener, landing

T = 1.0  # probe timeout: every port probed has a listener or refuses at once


def nft_ruleset(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"], check=True,
                          capture_output=True, text=True).stdout


def without_ours(ruleset: str) -> str:
    """``nft list ruleset`` text with our table cut out."""
    out, skip = [], False
    for line in ruleset.splitlines():
        if line.startswith(f"table {nr.FAMILY} {nr.TABLE} "):
            skip = True
        elif skip and line == "}":
            skip = False
            continue
        if not skip:
            out.append(line)
    return "\n".join(out).strip()


def sh(ns: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *argv], check=True, capture_output=True)


# --- rendering (no root) -------------------------------------------------------------


def test_render_is_deterministic_json_with_iptables_priorities() -> None:
    plan = build_plan(RedirectConfig(inbound_interception="TPROXY", dns_capture=True, capture_all_dns=True))
    a = json.dumps(nr.commands_for(nr.desired_ruleset(plan, (4, 6))))
    assert a == json.dumps(nr.commands_for(nr.desired_ruleset(build_plan(RedirectConfig(
        inbound_interception="TPROXY", dns_capture=True, capture_all_dns=True)), (4, 6))))
    cmds = json.loads(a)
    assert cmds[:3] == [{"add": {"table": {"family": "inet", "name": nr.TABLE}}},
                        {"delete": {"table": {"family": "inet", "name": nr.TABLE}}},
                        {"add": {"table": {"family": "inet", "name": nr.TABLE}}}]
    bases = {c["add"]["chain"]["name"]: (c["add"]["chain"]["type"], c["add"]["chain"]["prio"])
             for c in cmds if "chain" in c.get("add", {}) and "hook" in c["add"]["chain"]}
    assert bases == {"nat_OUTPUT": ("nat", -100),  # TPROXY: nat PREROUTING has no rules
                     "mangle_PREROUTING": ("filter", -150), "mangle_OUTPUT": ("route", -150),
                     "raw_OUTPUT": ("filter", -300), "raw_PREROUTING": ("filter", -300)}


def test_render_rules_in_nft_list_form() -> None:
    rs = nr.desired_ruleset(build_plan(RedirectConfig(outbound_exclude_ports=(22, 80))), (4, 6))
    texts = [nr.expr_text(*r) for r in rs["nat_OUTBOUND"].rules]
    assert 'tcp dport 22 return comment "redirect: excluded outbound port 22"' in texts
    assert 'oifname "lo" ip saddr 127.0.0.6 return comment "redirect: inbound passthrough from the proxy"' in texts
    assert rs["nat_REDIRECT"].rules == [([{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
                                          {"redirect": {"port": 15001}}], "redirect: to the proxy outbound port")]


def test_ipv4_only_config_leaves_ipv6_to_other_rules() -> None:
    rs = nr.desired_ruleset(build_plan(RedirectConfig(ipv6=False)), (4,))
    for spec in rs.values():
        if spec.base:
            assert nr.expr_text(*spec.rules[0]) == 'meta nfproto ipv6 return comment "redirect: IPv6 is not captured"'
    assert not any("ip6 " in nr.expr_text(*r) for s in rs.values() for r in s.rules)


def test_tproxy_delivers_or_drops_like_iptables() -> None:
    rs = nr.desired_ruleset(build_plan(RedirectConfig(inbound_interception="TPROXY")), (4, 6))
    texts = [nr.expr_text(*r) for r in rs["mangle_TPROXY"].rules]
    assert texts[0].startswith("ip daddr != 127.0.0.1 meta l4proto tcp tproxy ip to :15006 meta mark set 0x00000539"
                               " accept")
    assert texts[1].startswith("ip daddr != 127.0.0.1 meta l4proto tcp drop")


def test_partial_mask_connmark_copy_is_refused_by_name() -> None:
    plan = Plan("sidecar", (Chain("mangle", "OUTPUT", (Rule((), SaveMark(0xFFF)),), "output"),))
    with pytest.raises(BackendUnavailable, match="SaveMark"):
        nr.desired_ruleset(plan, (4, 6))


def test_listing_parses_back_to_the_rendered_ruleset() -> None:
    rs = nr.desired_ruleset(build_plan(RedirectConfig(drop_invalid=True)), (4, 6))
    items = [{"chain": {"family": "inet", "table": nr.TABLE, "name": n, "handle": i, **(s.base or {})}}
             for i, (n, s) in enumerate(rs.items())]
    items += [{"rule": {"family": "inet", "table": nr.TABLE, "chain": n, "handle": 99, "expr": e,
                        **({"comment": c} if c else {})}} for n, s in rs.items() for e, c in s.rules]
    parsed = nr.parse_listing(items)
    assert nr.diff_rulesets(parsed, rs) == []
    parsed["nat_OUTBOUND"].rules.pop(0)
    assert any(d.startswith("chain nat_OUTBOUND: missing rule:") for d in nr.diff_rulesets(parsed, rs))


def test_the_text_rendering_is_what_nft_lists_for_every_golden_config(pod: Pod) -> None:
    """``render`` (and the nftables goldens) print our table as ``nft list table inet rdr_redirect``
    prints it once installed: for every golden config, set up in a pod through the backend's JSON
    batch, the kernel's listing (through this machine's nft) is the rendered text, line for line."""
    from tests.golden import CONFIGS, config

    try:
        for name in CONFIGS:
            cfg = config(name)
            redirect.setup(pod.name, cfg, backend="nftables")
            listed = subprocess.run(["ip", "netns", "exec", pod.name, "nft", "list", "table", nr.FAMILY, nr.TABLE],
                                    check=True, capture_output=True, text=True, timeout=30).stdout
            assert listed == redirect.render(cfg, backend="nftables"), name
    finally:
        redirect.teardown(pod.name)


# --- traffic ---------------------------------------------------------------------------


@pytest.fixture
def proxy(pod: Pod) -> Iterator[dict[str, TcpListener]]:
    """The proxy's listeners in the pod (v4 and v6), and the app's in the peer."""
    ls = {
        "out4": TcpListener(pod.name, 15001, 4, label="proxy-out"),
        "out6": TcpListener(pod.name, 15001, 6, label="proxy-out"),
        "in4": TcpListener(pod.name, 15006, 4, label="proxy-in", transparent=True),
        "in6": TcpListener(pod.name, 15006, 6, label="proxy-in", transparent=True),
        "app4": TcpListener(pod.peer_name, 8080, 4, label="remote-app"),
        "app6": TcpListener(pod.peer_name, 8080, 6, label="remote-app"),
        "podapp4": TcpListener(pod.name, 8080, 4, label="pod-app"),
        "podapp6": TcpListener(pod.name, 8080, 6, label="pod-app"),
        "tunnel4": TcpListener(pod.name, 15008, 4, label="tunnel"),
        "stats4": TcpListener(pod.name, 15090, 4, label="stats"),
    }
    for lst in ls.values():
        lst.start()
    # A fresh pod's first IPv6 connection waits about 1 s for neighbour discovery: warm it up.
    landing(pod.name, pod.peer_ip6, 8080, *ls.values(), timeout=3.0)
    landing(pod.peer_name, pod.pod_ip6, 8080, *ls.values(), timeout=3.0)
    for lst in ls.values():
        lst.clear()
    try:
        yield ls
    finally:
        for lst in ls.values():
            lst.close()


@pytest.mark.parametrize("fam", [4, 6])
def test_outbound_is_captured_with_original_destination(pod: Pod, proxy: dict[str, TcpListener], fam: int) -> None:
    redirect.setup(pod.name, RedirectConfig(ipv6=True), backend="nftables")
    hit = landing(pod.name, pod.peer_ip(fam), 8080, *proxy.values(), timeout=T)
    assert hit.label == "proxy-out"
    assert hit.orig_dst == (pod.peer_ip(fam), 8080)


def test_proxy_uid_1337_is_not_captured(pod: Pod, proxy: dict[str, TcpListener]) -> None:
    redirect.setup(pod.name, RedirectConfig(ipv6=True), backend="nftables")
    for fam in (4, 6):
        assert landing(pod.name, pod.peer_ip(fam), 8080, *proxy.values(), uid=1337, timeout=T).label == "remote-app"
        assert landing(pod.name, pod.peer_ip(fam), 8080, *proxy.values(), uid=1000, timeout=T).label == "proxy-out"


def test_inbound_goes_to_15006_but_tunnel_and_excluded_ports_do_not(pod: Pod, proxy: dict[str, TcpListener]) -> None:
    redirect.setup(pod.name, RedirectConfig(ipv6=True, inbound_exclude_ports=(15090,)), backend="nftables")
    for fam in (4, 6):
        hit = landing(pod.peer_name, pod.pod_ip(fam), 8080, *proxy.values(), timeout=T)
        assert hit.label == "proxy-in" and hit.orig_dst == (pod.pod_ip(fam), 8080)
    assert landing(pod.peer_name, pod.pod_ip4, 15008, *proxy.values(), timeout=T).label == "tunnel"
    assert landing(pod.peer_name, pod.pod_ip4, 15090, *proxy.values(), timeout=T).label == "stats"


def test_excluded_cidr_is_not_captured(pod: Pod, proxy: dict[str, TcpListener]) -> None:
    cfg = RedirectConfig(ipv6=True, outbound_exclude_cidrs=(f"{pod.peer_ip4}/32",))
    redirect.setup(pod.name, cfg, backend="nftables")
    assert landing(pod.name, pod.peer_ip4, 8080, *proxy.values(), timeout=T).label == "remote-app"
    assert landing(pod.name, pod.peer_ip6, 8080, *proxy.values(), timeout=T).label == "proxy-out"


def test_ipv4_only_config_does_not_capture_ipv6(pod: Pod, proxy: dict[str, TcpListener]) -> None:
    redirect.setup(pod.name, RedirectConfig(ipv6=False), backend="nftables")
    assert landing(pod.name, pod.peer_ip4, 8080, *proxy.values(), timeout=T).label == "proxy-out"
    assert landing(pod.name, pod.peer_ip6, 8080, *proxy.values(), timeout=T).label == "remote-app"
    assert landing(pod.peer_name, pod.pod_ip6, 8080, *proxy.values(), timeout=T).label == "pod-app"


@pytest.mark.parametrize("fam", [4, 6])
def test_tproxy_inbound_keeps_the_original_destination_as_local_address(
    pod: Pod, proxy: dict[str, TcpListener], fam: int
) -> None:
    res = redirect.setup(pod.name, RedirectConfig(ipv6=True, inbound_interception="TPROXY"), backend="nftables")
    assert res.backend == "nftables" and res.changed
    hit = landing(pod.peer_name, pod.pod_ip(fam), 8080, *proxy.values(), timeout=T)
    assert hit.label == "proxy-in"
    assert hit.local == (pod.pod_ip(fam), 8080)
    assert redirect.check(pod.name, RedirectConfig(ipv6=True, inbound_interception="TPROXY"), backend="nftables").ok


def test_dns_udp_and_tcp_go_to_15053(pod: Pod) -> None:
    cfg = RedirectConfig(ipv6=True, dns_capture=True, capture_all_dns=True)
    with UdpListener(pod.name, 15053, 4, label="dns-udp") as du, \
            TcpListener(pod.name, 15053, 4, label="dns-tcp") as dt, \
            UdpListener(pod.peer_name, 53, 4, label="resolver-udp") as ru, \
            TcpListener(pod.peer_name, 53, 4, label="resolver-tcp") as rtl:
        redirect.setup(pod.name, cfg, backend="nftables")
        # The answer would need the DNS proxy's uid 1337 (CT zone 2): check where the query landed.
        hit = landing(pod.name, pod.peer_ip4, 53, du, ru, proto="udp", timeout=0.3)
        assert hit.listener is du
        hit = landing(pod.name, pod.peer_ip4, 53, dt, rtl, timeout=T)
        assert hit.label == "dns-tcp" and hit.orig_dst == (pod.peer_ip4, 53)
        # the DNS proxy's own upstream queries reach the resolver
        assert landing(pod.name, pod.peer_ip4, 53, du, ru, proto="udp", uid=1337, timeout=T).label == "resolver-udp"


FOREIGN_NFT = """table inet foreign {
\tchain out {
\t\ttype filter hook output priority 10; policy accept;
\t\ttcp dport 9998 accept
\t}
}
"""


def test_foreign_tables_and_rules_survive_setup_and_teardown(pod: Pod) -> None:
    sh(pod.name, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "9999", "-j", "ACCEPT")
    subprocess.run(["ip", "netns", "exec", pod.name, "nft", "-f", "-"], input=FOREIGN_NFT, text=True, check=True)
    before = nft_ruleset(pod.name)
    redirect.setup(pod.name, RedirectConfig(dns_capture=True, capture_all_dns=True), backend="nftables")
    during = nft_ruleset(pod.name)
    assert f"table inet {nr.TABLE}" in during
    assert without_ours(during) == before.strip()
    assert redirect.teardown(pod.name, backend="nftables")
    assert nft_ruleset(pod.name) == before


def test_setup_twice_is_setup_once(pod: Pod) -> None:
    cfg = RedirectConfig(inbound_interception="TPROXY", drop_invalid=True, dns_capture=True, capture_all_dns=True)
    first = redirect.setup(pod.name, cfg, backend="nftables")
    ruleset = nft_ruleset(pod.name)
    again = redirect.setup(pod.name, cfg, backend="nftables")
    assert first.changed and not again.changed
    assert nft_ruleset(pod.name) == ruleset
    assert redirect.check(pod.name, cfg, backend="nftables").ok


def test_the_fresh_pod_batch_deletes_nothing_and_leaves_a_table_made_meanwhile_alone(
        pod: Pod, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod without our table gets a batch that creates it (no delete: freeing the context of a
    batch that deleted objects waits for the kernel). Should the pod make a table of our name
    between our read and our batch, ``create`` fails the whole batch: their table is neither
    flushed nor merged with ours, and setup fails saying so; the next setup refuses it by name."""
    cfg = RedirectConfig()
    fresh = nr.commands_for(nr.desired_ruleset(build_plan(cfg), (4, 6)), fresh=True)
    assert not any("delete" in c or "flush" in c for c in fresh) and fresh[0] == {"create": {"table": nr.TABLE_OBJ}}
    theirs = "table inet rdr_redirect {\n chain input {\n  type filter hook input priority 0; policy accept;\n" \
             "  tcp dport 9999 drop\n }\n}\n"
    read, calls = nb.read_table, []

    def racing_read(nft: object, what: str = "setup") -> object:
        calls.append(what)
        if len(calls) == 1:  # what setup saw: no table; then the pod makes one before the batch
            subprocess.run(["ip", "netns", "exec", pod.name, "nft", "-f", "-"], input=theirs, text=True, check=True)
            return None
        return read(nft, what)  # type: ignore[arg-type]

    monkeypatch.setattr(nb, "read_table", racing_read)
    with pytest.raises(SetupError, match="File exists"):
        redirect.setup(pod.name, cfg, backend="nftables")
    want = nft_ruleset(pod.name)  # theirs alone, whole
    assert "tcp dport 9999 drop" in want and "chain input" in want
    assert "nat_OUTPUT" not in want and "comment" not in want
    monkeypatch.setattr(nb, "read_table", read)
    with pytest.raises(SetupError, match="not ours"):
        redirect.setup(pod.name, cfg, backend="nftables")
    assert nft_ruleset(pod.name) == want


def test_one_context_is_shared_within_a_block_and_applies_for_real(pod: Pod) -> None:
    """Inside ``one_context()`` every ``_context()`` is the same (``release`` keeps it for the block),
    it is a normal (not dry-run) context of the pod's netns, and outside each call gets its own."""
    from redirect.kernel import netns as rn

    with rn.enter(pod.name):
        with nb.one_context():
            a = nb._context()
            nb.release(a)
            b = nb._context()
            assert a is b
            rc, _, err = b.cmd("add table ip rdrt_probe_scope")
            assert rc == 0, err
        c, d = nb._context(), nb._context()
        assert c is not d and c is not a
        for x in (c, d):
            nb.release(x)
    assert "table ip rdrt_probe_scope" in nft_ruleset(pod.name)


def test_table_names_are_listed_once_per_block_until_tables_change(pod: Pod) -> None:
    """Inside ``one_context()`` the table list is kept until a batch of ours or an iptables exec
    (``forget_tables``); outside a block every call lists the kernel's tables again."""
    from redirect.backends import iptables as ipt
    from redirect.backends import iptables_nft
    from redirect.kernel import netns as rn

    with rn.enter(pod.name):
        with nb.one_context():
            nft = nb._context()
            assert nb.table_names(nft) == []
            sh(pod.name, "nft", "add", "table", "ip", "rdrt_behind_our_back")
            assert nb.table_names(nft) == []  # kept: nothing of ours changed tables
            ipt._run(["iptables-nft", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "4447", "-j", "ACCEPT"])
            names = nb.table_names(nft)  # an iptables exec forgets the list
            assert ("ip", "nat") in names and ("ip", "rdrt_behind_our_back") in names
            assert iptables_nft.xtables_tables(nft) == [("ip", "nat")]
            redirect.setup(pod.name, RedirectConfig(), backend="nftables")  # a batch of ours (nested scope)
            assert (nr.FAMILY, nr.TABLE) in nb.table_names(nft)
        other = nb._context()
        try:
            sh(pod.name, "nft", "delete", "table", "ip", "rdrt_behind_our_back")
            assert ("ip", "rdrt_behind_our_back") not in nb.table_names(other)
        finally:
            nb.release(other)
    # The nftables setup retired nothing of iptables-nft's that was not ours.
    out = subprocess.run(["ip", "netns", "exec", pod.name, "iptables-nft-save", "-t", "nat"], check=True,
                         capture_output=True, text=True).stdout
    assert "--dport 4447 -j ACCEPT" in out
    redirect.teardown(pod.name, backend="nftables")


def test_check_reports_drift_readably(pod: Pod) -> None:
    """A rule of ours changed is drift (setup repairs it); a rule that is not ours (no comment of
    ours) is named as not ours, and setup refuses rather than drop it."""
    cfg = RedirectConfig()
    redirect.setup(pod.name, cfg, backend="nftables")
    sh(pod.name, "nft", "add", "rule", "inet", nr.TABLE, "nat_OUTBOUND", "tcp", "dport", "7777", "return",
       "comment", '"redirect: loopback"')
    res = redirect.check(pod.name, cfg, backend="nftables")
    assert not res.ok
    assert res.differences == (
        'chain nat_OUTBOUND: unexpected rule: tcp dport 7777 return comment "redirect: loopback"',)
    assert redirect.setup(pod.name, cfg, backend="nftables").changed
    assert redirect.check(pod.name, cfg, backend="nftables").ok
    sh(pod.name, "nft", "add", "rule", "inet", nr.TABLE, "nat_OUTBOUND", "tcp", "dport", "7777", "return")
    res = redirect.check(pod.name, cfg, backend="nftables")
    assert res.differences == ("not ours, in our table (setup and teardown refuse until it is removed): rule in chain"
                               " nat_OUTBOUND: tcp dport 7777 return",), res.differences
    with pytest.raises(redirect.SetupError, match="rule in chain nat_OUTBOUND: tcp dport 7777 return"):
        redirect.setup(pod.name, cfg, backend="nftables")


def test_changed_config_replaces_ours(pod: Pod, proxy: dict[str, TcpListener]) -> None:
    redirect.setup(pod.name, RedirectConfig(ipv6=True, inbound_interception="TPROXY"), backend="nftables")
    cfg = RedirectConfig(ipv6=True, outbound_exclude_ports=(8080,))
    assert redirect.setup(pod.name, cfg, backend="nftables").changed
    assert redirect.check(pod.name, cfg, backend="nftables").ok  # TPROXY routes gone too
    assert landing(pod.name, pod.peer_ip4, 8080, *proxy.values(), timeout=T).label == "remote-app"


@pytest.mark.parametrize("how", ["route-step", "invalid-rule"])
def test_failure_half_way_leaves_the_netns_as_it_was(pod: Pod, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    redirect.setup(pod.name, RedirectConfig(), backend="nftables")
    before = nft_ruleset(pod.name)
    routes_before = subprocess.run(["ip", "-n", pod.name, "rule"], capture_output=True, text=True).stdout
    if how == "route-step":
        monkeypatch.setenv("REDIRECT_FAULT", "nftables.before_transaction")
    else:
        bad = {"add": {"rule": {"family": "inet", "table": nr.TABLE, "chain": "nat_OUTBOUND",
                                "expr": [{"jump": {"target": "no_such_chain"}}]}}}
        monkeypatch.setattr(nb, "_EXTRA_COMMANDS_FOR_TESTS", [bad])
    with pytest.raises(SetupError):
        redirect.setup(pod.name, RedirectConfig(inbound_interception="TPROXY"), backend="nftables")
    assert nft_ruleset(pod.name) == before
    assert subprocess.run(["ip", "-n", pod.name, "rule"], capture_output=True, text=True).stdout == routes_before


def test_teardown_leaves_the_ruleset_as_before(pod: Pod) -> None:
    before = nft_ruleset(pod.name)
    redirect.setup(pod.name, RedirectConfig(inbound_interception="TPROXY"), backend="nftables")
    assert redirect.teardown(pod.name, backend="nftables")
    assert nft_ruleset(pod.name) == before
    assert "lookup 133" not in subprocess.run(["ip", "-n", pod.name, "rule"], capture_output=True, text=True).stdout
    assert not redirect.teardown(pod.name, backend="nftables")


@pytest.mark.parametrize("first,second", [("iptables", "nftables"), ("nftables", "iptables")])
def test_switching_backend_moves_capture_without_doubling(
    pod: Pod, proxy: dict[str, TcpListener], first: str, second: str
) -> None:
    cfg = RedirectConfig(ipv6=True, inbound_interception="TPROXY")
    redirect.setup(pod.name, cfg, backend=first)
    assert landing(pod.name, pod.peer_ip4, 8080, *proxy.values(), timeout=T).label == "proxy-out"
    res = redirect.setup(pod.name, cfg, backend=second)
    assert res.backend == second and res.changed
    assert redirect.check(pod.name, cfg, backend=second).ok  # routes kept
    assert not redirect.show(pod.name, backend=first)["installed"]
    for fam in (4, 6):
        hit = landing(pod.name, pod.peer_ip(fam), 8080, *proxy.values(), timeout=T)
        assert hit.label == "proxy-out" and hit.orig_dst == (pod.peer_ip(fam), 8080)
        hit = landing(pod.peer_name, pod.pod_ip(fam), 8080, *proxy.values(), timeout=T)
        assert hit.label == "proxy-in" and hit.local == (pod.pod_ip(fam), 8080)


@pytest.mark.parametrize("cfg, want, why", [
    (RedirectConfig(), "ebpf", None),
    (RedirectConfig(inbound_interception="TPROXY", proxy_uids=tuple(range(3000, 3020))), "ebpf", None),
    (RedirectConfig(drop_invalid=True), "nftables", "drop_invalid=True is not available with eBPF"),
    (RedirectConfig(mode="ambient"), "ebpf", None),
], ids=["default", "tproxy-many-uids", "drop-invalid", "ambient"])
def test_auto_prefers_ebpf_else_nftables_and_says_why(pod: Pod, ebpf_root: str, caplog: pytest.LogCaptureFixture,
                                                     cfg: RedirectConfig, want: str, why: str | None) -> None:
    """``auto``: eBPF when this host allows it and it supports every option of the config; else
    nftables (the kernel here takes an inet nat table), with eBPF's refusal in the log."""
    caplog.set_level(logging.INFO, logger="redirect.backends")
    res = redirect.setup(pod.name, cfg, backend="auto")
    try:
        assert res.backend == want
        assert redirect.show(pod.name)["backend"] == want
        msg = [r.getMessage() for r in caplog.records if "backend=auto" in r.getMessage()]
        assert msg and msg[-1].startswith(f"backend=auto: chose {want}"), msg
        if why is not None:
            assert why in msg[-1], msg
        if cfg.mode == "sidecar":  # captured: the app's outbound lands on the proxy
            with TcpListener(pod.name, 15001, label="proxy-out") as proxy, \
                    TcpListener(pod.peer_name, 8080, label="peer") as peer:
                assert landing(pod.name, pod.peer_ip4, 8080, proxy, peer, uid=1000).label == "proxy-out"
        assert redirect.check(pod.name, cfg, backend="auto").ok
    finally:
        assert redirect.teardown(pod.name, backend="auto")
    assert not redirect.show(pod.name)["installed"]


@pytest.fixture(params=["root-not-bpffs", "cgroup-not-cgroup"])
def ebpf_cannot_load(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """eBPF that the host probe allows but that cannot load here, for real: its pin root under
    /sys/fs/bpf on a tmpfs mounted there (not a bpffs: the load finds it out), or its cgroup a
    plain directory with a ``cgroup.procs`` file (the programs compile and load, the attach
    fails). What the probe saw is given; what the load would say is yielded."""
    from redirect import backends
    from redirect.backends import ebpf

    base = f"/sys/fs/bpf/rdrt-auto-{os.getpid()}"
    root = f"{base}/root" if request.param == "root-not-bpffs" else base
    env = {"REDIRECT_BPF_ROOT": root, "REDIRECT_BPF_CGROUP": os.environ.get("REDIRECT_BPF_CGROUP")}
    if request.param == "root-not-bpffs":
        os.mkdir(base)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "rdrt-auto", base], check=True)
        want = "is not on a bpffs mount"
    else:
        (tmp_path / "cgroup.procs").write_text("")
        env["REDIRECT_BPF_CGROUP"] = str(tmp_path)
        want = "attaching"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    try:
        assert ebpf.refusal(intent_for(RedirectConfig())) is None  # the probe allows it: only loading tells
        yield want
    finally:
        try:  # the mount and the pins first: nothing below may leave them
            if request.param == "root-not-bpffs":
                subprocess.run(["umount", base], check=True)
            else:
                ebpf.force_unload_host(root)
            if os.path.isdir(base):
                os.rmdir(base)
        finally:
            for k, v in old.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            backends._ebpf_load_failures.pop(root, None)
        assert not os.path.exists(base), f"left {base}"


def test_auto_falls_back_when_ebpf_cannot_load_here(pod: Pod, ebpf_cannot_load: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """``auto`` with eBPF allowed by the probe and the config, but unable to load or attach here:
    nftables instead, the reason in the log; the pod is captured, nothing of eBPF is left, and
    the process's next ``auto`` choice skips eBPF with that reason."""
    caplog.set_level(logging.INFO, logger="redirect.backends")
    cfg = RedirectConfig()
    res = redirect.setup(pod.name, cfg, backend="auto")
    try:
        assert res.backend == "nftables"
        assert redirect.show(pod.name)["backends"] == ["nftables"]
        msg = [r.getMessage() for r in caplog.records if "backend=auto" in r.getMessage()]
        assert msg[0].startswith("backend=auto: chose ebpf"), msg
        assert msg[-1].startswith("backend=auto: chose nftables, not ebpf (could not load or attach here: "), msg
        assert ebpf_cannot_load in msg[-1], msg
        with TcpListener(pod.name, 15001, label="proxy-out") as proxy, \
                TcpListener(pod.peer_name, 8080, label="peer") as peer:
            assert landing(pod.name, pod.peer_ip4, 8080, proxy, peer, uid=1000).label == "proxy-out"
        caplog.clear()
        assert redirect.setup(pod.name, cfg, backend="auto").backend == "nftables"
        msg = [r.getMessage() for r in caplog.records if "backend=auto" in r.getMessage()]
        assert msg == [m for m in msg if "not ebpf (could not load or attach here earlier in this process: " in m]
        assert len(msg) == 1 and ebpf_cannot_load in msg[0], msg
    finally:
        assert redirect.teardown(pod.name)
    assert not redirect.show(pod.name)["installed"]


@pytest.mark.parametrize("cfg", [
    RedirectConfig(mode="ambient", dns_capture=True, capture_all_dns=True, ipv6=True),
    RedirectConfig(mode="ambient", ipv6=False),
    RedirectConfig(exclude_interfaces=("veth9",), reroute_interfaces=("kv0",), owner_groups=((1000, 2000),),
                   dns_capture=True, dns_servers=("10.0.0.10", "fd00::10"), drop_invalid=True, ipv6=True),
], ids=["ambient-dns", "ambient-v4", "sidecar-wide"])
def test_installed_table_reads_back_equal_to_the_render(pod: Pod, cfg: RedirectConfig) -> None:
    assert redirect.setup(pod.name, cfg, backend="nftables").changed
    assert not redirect.setup(pod.name, cfg, backend="nftables").changed
    assert redirect.check(pod.name, cfg, backend="nftables").differences == ()
