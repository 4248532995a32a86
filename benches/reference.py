"""The references: what Istio does per pod, the way Istio does it, in the pod's netns.

Sidecar (``reference/istio-iptables/sidecar``): ``istio-iptables`` as the injected init container runs
it (``-p 15001 -z 15006 -u 1337 -g 1337 -m REDIRECT -i '*' -b '*' -d 15090,15021,15020``), and as
the istio-cni plugin runs the same code per pod, in a fresh netns with IPv6 rules on (both
families, as ours). Its order (istio/istio ``tools/istio-iptables``: ``capture/run.go``,
``capture/helper.go``, ``dependencies/implementation.go`` and ``implementation_linux.go``):

1. the iptables variant, detected for each family: legacy first, then nft (a fresh netns has no
   legacy rules, so nft is chosen), each by ``<bin>-save``, ``<bin>-save --version``, and a
   probe rule added and deleted (``<bin> -t nat -A/-D INPUT -p 255 -j RETURN``, with ``--wait=30``
   for legacy): 16 execs;
2. the state before, one save per family (``VerifyIptablesState``): 2;
3. ``iptables-restore --noflush`` and ``ip6tables-restore --noflush`` of Istio's default sidecar
   ruleset (written out as Istio's restore payload with ``-N``/``-A`` lines and ISTIO_* chains, as
   in its golden files ``tools/istio-iptables/pkg/capture/testdata/``): 2;
4. the state after, one save per family (logged): 2.

22 execs. ``reference/istio-iptables-core/sidecar`` is steps 2 to 4 alone (6 execs), without the
detection: reported beside it, so a ratio against Istio's sequence is never read as more than
the restore part of it.

Ambient (``reference/istio-cni/ambient``): what istio-cni's node agent does in a pod's netns when
the pod joins the ambient mesh (in-pod redirection; ``cni/pkg/iptables/iptables.go``
``CreateInpodRules``, ``iptables_linux.go``): lo looked up and its ``disable_ipv6`` read, the local
default route in table 100 and the rule ``fwmark 0x111/0xfff lookup 100`` of each family (netlink;
here one batch of ours, which is cheaper than the agent's one socket per call), then one save per
family and ``iptables-restore --noflush`` / ``ip6tables-restore --noflush`` of its in-pod ruleset
(mangle and nat; DNS capture off, as in the ambient config measured): 4 execs. The agent detects
the iptables variant once, when it starts, not per pod.

Not included, so each reference is a lower bound of Istio's cost: Istio's process start (a Go
binary in an init container, or the CNI plugin's exec), the node agent's per-exec sandbox (a
throw-away thread, a mount namespace and two mounts), its host-side ipset entry, hand-off to
ztunnel and Kubernetes API call.

Teardown (the sidecar references): ``istio-iptables --cleanup-only``'s deletes, one exec per
command: the jumps, then flush and delete each chain, per family, in the nat table (20 execs; the
current release also detects the variant and saves before and after, so this is a lower bound).
A deleted ambient pod's netns gets nothing from Istio.
"""

from __future__ import annotations

import subprocess

CHAINS = ("ISTIO_INBOUND", "ISTIO_REDIRECT", "ISTIO_IN_REDIRECT", "ISTIO_OUTPUT")


def ruleset(family: int) -> str:
    lo4, pass4 = ("127.0.0.1/32", "127.0.0.6/32") if family == 4 else ("::1/128", "::6/128")
    lines = ["* nat"]
    lines += [f"-N {c}" for c in CHAINS]
    lines += [
        "-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN",
        "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
        "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006",
        "-A PREROUTING -p tcp -j ISTIO_INBOUND",
        "-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN",
        "-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        f"-A ISTIO_OUTPUT -o lo -s {pass4} -j RETURN",
    ]
    for kind in ("uid", "gid"):
        lines += [
            f"-A ISTIO_OUTPUT -o lo ! -d {lo4} -p tcp ! --dport 15008 -m owner --{kind}-owner 1337"
            " -j ISTIO_IN_REDIRECT",
            f"-A ISTIO_OUTPUT -o lo -m owner ! --{kind}-owner 1337 -j RETURN",
            f"-A ISTIO_OUTPUT -m owner --{kind}-owner 1337 -j RETURN",
        ]
    lines += [f"-A ISTIO_OUTPUT -d {lo4} -j RETURN", "-A ISTIO_OUTPUT -j ISTIO_REDIRECT", "COMMIT"]
    return "\n".join(lines) + "\n"


#: istio-cni's in-pod marks and table (its defaults; ``proxy_mark``, ``conn_mark`` and ``route_table``
#: of the ambient config are the same).
AMBIENT_MARK, AMBIENT_TABLE = 0x111, 100
_PROBE_SNAT = {4: "169.254.7.127", 6: "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"}


def ambient_ruleset(family: int) -> str:
    """istio-cni's in-pod ruleset with DNS capture off (its golden file
    ``cni/pkg/iptables/testdata/dns_pod_disabled_and_on_globally.golden``, and its IPv6 twin)."""
    lo, snat = ("127.0.0.1/32" if family == 4 else "::1/128"), _PROBE_SNAT[family]
    return "\n".join([
        "* mangle", "-N ISTIO_PRERT", "-N ISTIO_OUTPUT", "-A PREROUTING -j ISTIO_PRERT", "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
        "-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff"
        " --ctmask 0xffffffff",
        "COMMIT",
        "* nat", "-N ISTIO_PRERT", "-N ISTIO_OUTPUT", "-A OUTPUT -j ISTIO_OUTPUT", "-A PREROUTING -j ISTIO_PRERT",
        f"-A ISTIO_PRERT -s {snat} -p tcp -m tcp -j ACCEPT",
        f"-A ISTIO_OUTPUT -d {snat} -p tcp -m tcp -j ACCEPT",
        f"-A ISTIO_PRERT ! -d {lo} -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006",
        "-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT",
        f"-A ISTIO_OUTPUT ! -d {lo} -o lo -j ACCEPT",
        f"-A ISTIO_OUTPUT ! -d {lo} -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001",
        "COMMIT"]) + "\n"


#: Istio's cleanup order: the referring chains first, so every -X succeeds.
TEARDOWN_ORDER = ("ISTIO_OUTPUT", "ISTIO_INBOUND", "ISTIO_REDIRECT", "ISTIO_IN_REDIRECT")
RULES = {4: ruleset(4).encode(), 6: ruleset(6).encode()}
RULE_COUNT = sum(line.startswith("-A ") for line in ruleset(4).splitlines())
AMBIENT_RULES = {4: ambient_ruleset(4).encode(), 6: ambient_ruleset(6).encode()}
AMBIENT_RULE_COUNT = sum(line.startswith("-A ") for line in ambient_ruleset(4).splitlines())


def _run(argv: list[str], data: bytes | None = None) -> bytes:
    r = subprocess.run(argv, input=data, capture_output=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


#: The per-pod phase's keys of the references.
KEYS = {"sidecar": "reference/istio-iptables/sidecar", "core": "reference/istio-iptables-core/sidecar",
        "ambient": "reference/istio-cni/ambient"}

#: (binary, probe rule's extra arguments) of each variant, in the order Istio tries them.
VARIANTS = (("legacy", ("--wait=30",)), ("nft", ()))
PROBE = ("-t", "nat", "-{op}", "INPUT", "-p", "255", "-j", "RETURN")


def _bin(variant: str, family: int, tool: str = "") -> str:
    return f"{'ip' if family == 4 else 'ip6'}tables-{variant}{tool}"


def detect(family: int) -> str:
    """The variant Istio picks for ``family`` here (``DetectIptablesVersion``): legacy if its save
    shows rules, else nft if its probe rule can be added, else legacy; its execs as Istio makes them."""
    for variant, extra in VARIANTS:
        dump = _run([_bin(variant, family, "-save")])
        _run([_bin(variant, family, "-save"), "--version"])
        r = subprocess.run([_bin(variant, family), *(a.format(op="A") for a in PROBE), *extra],
                           capture_output=True, timeout=30)
        if r.returncode == 0:
            _run([_bin(variant, family), *(a.format(op="D") for a in PROBE), *extra])
            if variant == "nft" or dump.count(b"\n") >= 3:
                return variant
        elif variant == "nft":
            raise RuntimeError(f"reference: {_bin(variant, family)} cannot add a rule: {r.stderr.decode().strip()}")
    return "legacy"


def setup_core(variant: str = "nft") -> None:
    """Saves, the restore of each family, saves again (the current netns; the caller entered it)."""
    _run([_bin(variant, 4, "-save")])
    _run([_bin(variant, 6, "-save")])
    _run([_bin(variant, 4, "-restore"), "--noflush"], RULES[4])
    _run([_bin(variant, 6, "-restore"), "--noflush"], RULES[6])
    out = _run([_bin(variant, 4, "-save")])
    _run([_bin(variant, 6, "-save")])
    if b"ISTIO_OUTPUT" not in out:
        raise RuntimeError("reference: ISTIO_OUTPUT missing after restore")


def setup() -> None:
    """Istio's per-pod sidecar sequence in the current netns: the detection, then ``setup_core``."""
    v4, v6 = detect(4), detect(6)
    if v4 != v6:
        raise RuntimeError(f"reference: Istio would pick {v4} for IPv4 and {v6} for IPv6 here")
    setup_core(v4)


def install_rules() -> None:
    """Istio's sidecar rules alone (the data path's comparison), with the variant a fresh netns gets."""
    _run([_bin("nft", 4, "-restore"), "--noflush"], RULES[4])
    _run([_bin("nft", 6, "-restore"), "--noflush"], RULES[6])


def setup_ambient() -> None:
    """What istio-cni's node agent does in the current netns for a pod joining the ambient mesh."""
    from redirect.kernel import netlink
    from redirect.kernel import routes as rt
    from redirect.native import load

    netlink.link_index("lo")
    with open("/proc/sys/net/ipv6/conf/lo/disable_ipv6") as f:
        f.read()
    native = load()
    ffi, lib = native.ffi, native.lib
    ops = ffi.new("struct rdr_route_op[]", 4)
    # (as routes.route_ops lays them out, with the agent's protocol, RTPROT_BOOT, and rule priority: the
    # local default routes first, then the rules)
    for o, (kind, family) in zip(ops, ((rt.ROUTE, 4), (rt.ROUTE, 6), (rt.RULE, 4), (rt.RULE, 6)), strict=True):
        o.kind, o.add, o.family, o.proto, o.table, o.fwmark, o.mask, o.priority, o.oif = (
            (kind, 1, family, 3, AMBIENT_TABLE, AMBIENT_MARK, 0xFFF, 32764, 0) if kind == rt.RULE else
            (kind, 1, family, 3, AMBIENT_TABLE, 0, 0, 0, rt.LOOPBACK_IFINDEX))
    errs = ffi.new("int[4]")
    ret = lib.rdr_route_ops(-1, ops, 4, errs)
    if ret < 0 or any(errs[i] < 0 for i in range(4)):
        raise RuntimeError(f"reference: ambient routes: {ret} {[errs[i] for i in range(4)]}")
    _run(["iptables-nft-save"])
    _run(["ip6tables-nft-save"])
    _run(["iptables-nft-restore", "--noflush", "-v"], AMBIENT_RULES[4])
    _run(["ip6tables-nft-restore", "--noflush", "-v"], AMBIENT_RULES[6])


def teardown(variant: str = "nft") -> None:
    """``istio-iptables --cleanup-only``'s deletes in the nat table: one exec per command, per family."""
    for fam in (4, 6):
        cmd = _bin(variant, fam)
        for args in (["-D", "PREROUTING", "-p", "tcp", "-j", "ISTIO_INBOUND"], ["-D", "OUTPUT", "-j", "ISTIO_OUTPUT"]):
            subprocess.run([cmd, "-t", "nat", *args], capture_output=True, timeout=30)
        for chain in TEARDOWN_ORDER:
            subprocess.run([cmd, "-t", "nat", "-F", chain], capture_output=True, timeout=30)
            subprocess.run([cmd, "-t", "nat", "-X", chain], capture_output=True, timeout=30)
