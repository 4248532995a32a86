"""The reference: Istio's per-pod sequence, done the way ``istio-iptables`` does it.

Setup (in the pod netns): exec ``iptables-save`` and ``ip6tables-save``; ``iptables-restore
--noflush`` and ``ip6tables-restore --noflush`` of Istio's default sidecar ruleset (``-p 15001 -z
15006 -u 1337 -g 1337 -m REDIRECT -i '*' -b '*' -d 15090,15021,15020``, written out as Istio's
restore payload with plain ``-N``/``-A`` lines and ISTIO_* chains, as in its golden files
tools/istio-iptables/pkg/capture/testdata/); then both saves again (Istio's verification).

Teardown: ``istio-iptables --cleanup-only`` runs one exec per command: delete the jumps, then
flush and delete each chain, per family. We do the nat-table subset of that (20 execs); Istio
also tries the mangle table, so this is a lower bound on its cleanup cost.

Istio's process start (a Go binary in an init container) is not included: the reference is
the exec sequence only, compared with our in-process API and, separately, our ``redirect init``.
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
        "-A OUTPUT -p tcp -j ISTIO_OUTPUT",
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


#: Istio's cleanup order: the referring chains first, so every -X succeeds.
TEARDOWN_ORDER = ("ISTIO_OUTPUT", "ISTIO_INBOUND", "ISTIO_REDIRECT", "ISTIO_IN_REDIRECT")
RULES = {4: ruleset(4).encode(), 6: ruleset(6).encode()}
RULE_COUNT = sum(line.startswith("-A ") for line in ruleset(4).splitlines())


def _run(argv: list[str], data: bytes | None = None) -> bytes:
    r = subprocess.run(argv, input=data, capture_output=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def setup(binary: str = "iptables") -> None:
    """Istio's per-pod sequence in the current netns (the caller has entered it)."""
    v6 = binary.replace("iptables", "ip6tables")
    _run([f"{binary}-save"])
    _run([f"{v6}-save"])
    _run([f"{binary}-restore", "--noflush"], RULES[4])
    _run([f"{v6}-restore", "--noflush"], RULES[6])
    out = _run([f"{binary}-save"])
    _run([f"{v6}-save"])
    if b"ISTIO_OUTPUT" not in out:
        raise RuntimeError("reference: ISTIO_OUTPUT missing after restore")


def teardown(binary: str = "iptables") -> None:
    """``istio-iptables --cleanup-only``'s nat subset: one exec per command, per family."""
    for cmd in (binary, binary.replace("iptables", "ip6tables")):
        for args in (["-D", "PREROUTING", "-p", "tcp", "-j", "ISTIO_INBOUND"],
                     ["-D", "OUTPUT", "-p", "tcp", "-j", "ISTIO_OUTPUT"]):
            subprocess.run([cmd, "-t", "nat", *args], capture_output=True, timeout=30)
        for chain in TEARDOWN_ORDER:
            subprocess.run([cmd, "-t", "nat", "-F", chain], capture_output=True, timeout=30)
            subprocess.run([cmd, "-t", "nat", "-X", chain], capture_output=True, timeout=30)
