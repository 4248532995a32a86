"""A setup killed at any point leaves no bypass, ``check`` says so, and the next setup repairs it.

A forked copy of this process runs ``redirect.setup`` from one config to another and is
SIGKILLed (with its process group: an ``iptables-restore`` in flight dies too) after a random
delay, or at a named step (``REDIRECT_FAULT=<point>:kill``). Then, in the state left behind:

- exactly: our rules (every line of ours in ``iptables-save``, or our nft table) and our policy
  routes and addresses are read back, and at least one config is whole in them: every line and
  route it has when it is installed alone, so the namespace captures at least what that config
  captures (rules of the other config beside it only capture more). The config whole is the old
  one or the new one, and nothing is there that neither has;
- with traffic, for a sample of kills: every probe connection that a whole config captures is
  captured;
- ``check`` against either config reports differences when the state is neither, naming an
  interrupted setup when two generations of iptables chains are present;
- sometimes a second setup, to a third config, is killed on top of the first; then a setup
  repairs: ``check`` is ok and the rules are exactly those of a plain setup.

The eBPF backend's general path is killed the same way and checked by traffic only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import redirect
from redirect import RedirectConfig
from redirect.kernel import routes as rt
from tests.netkit import Pod, TcpListener, landing

POOL = [
    RedirectConfig(),
    RedirectConfig(outbound_exclude_ports=(9090,), dns_capture=True),
    RedirectConfig(inbound_interception="TPROXY"),
    RedirectConfig(inbound_ports=(8000,), outbound_exclude_cidrs=("10.0.0.0/8",)),
    RedirectConfig(mode="ambient"),
    RedirectConfig(ipv6=False),
]
#: Random kills per backend, and the named steps killed at (each for several config pairs).
KILLS = {"iptables-nft": 70, "iptables-legacy": 70, "nftables": 100}
POINTS = {
    "iptables": ["iptables.before_restore_v6", "iptables.before_restore_v4", "iptables.remove_v4",
                 "iptables.remove_v6", "iptables.before_routes_finish"],
    "nftables": ["nftables.before_transaction", "nftables.after_transaction"],
}
APP_UID = 1000
PR_SET_CHILD_SUBREAPER = 36


Lines = frozenset[tuple[int, str, str]]  # (family, table, line) of ours


def our_lines(ns: str, backend: str) -> Lines:
    """Our state, read back: iptables lines naming our chains; the nft table's listing."""
    out = set()
    if backend == "nftables":
        p = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "rdr_redirect"],
                           capture_output=True, text=True, check=False)
        return frozenset((0, "inet", ln) for ln in p.stdout.splitlines()) if p.returncode == 0 else frozenset()
    variant = backend.split("-")[1]
    for fam, tool in ((4, "iptables"), (6, "ip6tables")):
        text = subprocess.run(["ip", "netns", "exec", ns, f"{tool}-{variant}-save"], capture_output=True,
                              text=True, check=True).stdout
        table = ""
        for ln in text.splitlines():
            if ln.startswith("*"):
                table = ln[1:]
            elif re.search(r"\bRDR2?_", ln):
                out.add((fam, table, re.sub(r"\[\d+:\d+\]", "", ln)))
    return frozenset(out)


def generations(lines: Lines) -> set[str]:
    return {m.group(0) for _, _, ln in lines for m in [re.search(r"\bRDR2?_", ln)] if m}


RouteLines = frozenset[str]


def our_routes(pod: Pod) -> RouteLines:
    st = pod.run(rt.read_ours)
    return frozenset([repr(r) for r in st.routes] + [repr(a) for a in st.addresses])


@dataclass
class Known:
    """What each config looks like installed alone: lines per generation, routes, captured probes."""

    lines: dict[tuple[int, str], Lines] = field(default_factory=dict)  # (config, generation) ->
    routes: dict[int, RouteLines] = field(default_factory=dict)
    captures: dict[int, frozenset[str]] = field(default_factory=dict)

    def whole(self, lines: Lines, routes: RouteLines) -> set[int]:
        """The configs whole in the state: the lines of one generation's chains (and the jumps to
        them) are exactly the config's in that generation, and its routes are all there. (Rules
        of the other generation beside them only add capture: theirs come first in a built-in
        chain only while they are a whole config themselves.)"""
        return {c for (c, gen), ls in self.lines.items()
                if {x for x in lines if gen in x[2] or not gen} == ls and self.routes[c] <= routes}

    def exact(self, lines: Lines, routes: RouteLines) -> set[int]:
        return {c for (c, _), ls in self.lines.items() if ls == lines and self.routes[c] == routes}


class Probes:
    """Listeners in the pod and its peer, and the probe connections, by name."""

    def __init__(self, pod: Pod, st: contextlib.ExitStack) -> None:
        self.pod = pod
        self.proxy = []
        for fam in (4, 6):
            self.proxy.append(st.enter_context(TcpListener(pod.name, 15001, family=fam, label="proxy")))
            self.proxy.append(st.enter_context(TcpListener(pod.name, 15006, family=fam, transparent=True,
                                                           label="proxy")))
        self.others = [st.enter_context(TcpListener(pod.name, 8000, family=f, label="app")) for f in (4, 6)]
        self.others += [st.enter_context(TcpListener(pod.peer_name, 8080, family=f, label="peer")) for f in (4, 6)]
        self.others.append(st.enter_context(TcpListener(pod.peer_name, 9090, family=4, label="peer")))
        self.all = self.proxy + self.others
        self.specs = {
            "out4": (pod.name, pod.peer_ip4, 8080, APP_UID), "out6": (pod.name, pod.peer_ip6, 8080, APP_UID),
            "out4-9090": (pod.name, pod.peer_ip4, 9090, APP_UID),
            "in4": (pod.peer_name, pod.pod_ip4, 8000, None), "in6": (pod.peer_name, pod.pod_ip6, 8000, None),
        }

    def landings(self) -> dict[str, str | None]:
        """Where each probe lands: ``proxy``, ``app``, ``peer``, or None (no answer)."""
        return {name: landing(ns, ip, port, *self.all, uid=uid, timeout=2.0).label
                for name, (ns, ip, port, uid) in self.specs.items()}

    def captured(self) -> frozenset[str]:
        return frozenset(name for name, label in self.landings().items() if label == "proxy")


def killed_setup(ns: str, cfg: RedirectConfig, backend: str, delay: float, point: str | None = None) -> None:
    """``setup`` in a forked child, SIGKILLed with its process group after ``delay`` s (or at ``point``,
    if the setup reaches it)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setpgid(0, 0)
            if point:
                os.environ["REDIRECT_FAULT"] = f"{point}:kill"
            redirect.setup(ns, cfg, backend=backend)
        finally:
            os._exit(0)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)
    deadline = time.monotonic() + (delay if point is None else 10.0)
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(min(0.0005, max(0.0, deadline - time.monotonic())))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    # Its children (an iptables-restore in flight), killed with it, are ours now (subreaper): reap them.
    while True:
        try:
            os.waitpid(-pid, 0)
        except ChildProcessError:
            return


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """Orphans of the killed setups are reparented to this process, to be reaped at once (the
    namespace's init may take its time: a zombie keeps the process group alive)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def timed_setup(ns: str, cfg: RedirectConfig, backend: str) -> float:
    t0 = time.perf_counter()
    _forked(ns, cfg, backend)
    return time.perf_counter() - t0


def _forked(ns: str, cfg: RedirectConfig, backend: str) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            redirect.setup(ns, cfg, backend=backend)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@contextlib.contextmanager
def probes_for(pod: Pod) -> Iterator[Probes]:
    with contextlib.ExitStack() as st:
        p = Probes(pod, st)
        for _ in range(50):  # a fresh pod's first IPv6 connection waits for its addresses
            if landing(pod.name, pod.peer_ip6, 8080, *p.all, timeout=0.5).label == "peer":
                break
        yield p


@pytest.mark.parametrize("backend", list(KILLS))
def test_a_setup_killed_anywhere_leaves_no_bypass_and_is_repaired(pod: Pod, backend: str) -> None:
    seed = int(os.environ.get("REDIRECT_KILL_SEED") or int.from_bytes(os.urandom(4), "big"))
    rnd = random.Random(seed)
    kind = "nftables" if backend == "nftables" else "iptables"
    known = Known()
    n = len(POOL)
    t_start = time.monotonic()
    with probes_for(pod) as probes, subreaper():
        # Each config installed alone, in each generation: its lines, routes and what it captures.
        for i in list(range(n)) + [(i + 1) % n for i in range(n)]:
            redirect.setup(pod.name, POOL[i], backend=backend)
            lines = our_lines(pod.name, backend)
            gens = generations(lines)
            assert len(gens) <= 1 and redirect.check(pod.name, POOL[i], backend=backend).ok
            known.lines[(i, gens.pop() if gens else "")] = lines
            known.routes[i] = our_routes(pod)
            if i not in known.captures:
                known.captures[i] = probes.captured()
        assert len(known.lines) >= n
        cur = 0  # the last one installed
        durations = sorted(timed_setup(pod.name, POOL[j], backend) for j in (1, 2, 0))
        span = durations[1] * 1.3
        points = [(p, a) for p in POINTS[kind] for a in range(3)]
        kills = KILLS[backend] + len(points)
        bypass_checked = 0
        for k in range(kills):
            target = rnd.choice([j for j in range(n) if j != cur])
            before_whole = known.whole(our_lines(pod.name, backend), our_routes(pod))
            point = points[k - KILLS[backend]][0] if k >= KILLS[backend] else None
            chain = rnd.random() < 0.3 and point is None
            killed_setup(pod.name, POOL[target], backend, rnd.uniform(0, span), point)
            allowed = before_whole | {target}
            involved = set(allowed)  # what may have left lines
            if chain:  # a second setup, killed too, on top of the interrupted one
                lines, routes = our_lines(pod.name, backend), our_routes(pod)
                mid = known.whole(lines, routes) & allowed
                assert mid, f"after a kill toward {target} (seed {seed}): no whole config"
                target = rnd.choice(range(n))
                allowed = mid | {target}
                involved.add(target)
                killed_setup(pod.name, POOL[target], backend, rnd.uniform(0, span))
            lines, routes = our_lines(pod.name, backend), our_routes(pod)
            whole = known.whole(lines, routes) & allowed
            assert whole, (f"kill {k} (seed {seed}, point {point}) toward config {target} left no whole config of"
                           f" {sorted(allowed)}:\n" + "\n".join(sorted(map(str, lines))) + f"\n{sorted(routes)}")
            every = frozenset().union(*(known.lines[key] for key in known.lines if key[0] in involved))
            assert lines <= every, (f"kill {k} (seed {seed}, point {point}, allowed {sorted(allowed)}, toward"
                                    f" {target}): lines neither config has: {sorted(lines - every)}")
            exact = known.exact(lines, routes)
            if not exact:
                for c in allowed:
                    res = redirect.check(pod.name, POOL[c], backend=backend)
                    assert not res.ok
                    if len(generations(lines)) == 2:
                        assert any(d.startswith("interrupted setup") for d in res.differences), res.differences
            if point is not None or k % 8 == 0:
                must = frozenset().union(*(known.captures[c] for c in whole))
                got = probes.landings()
                assert must <= {p for p, label in got.items() if label == "proxy"}, (
                    f"bypass after kill {k} (seed {seed}, point {point}, whole configs {sorted(whole)}): {got}\n"
                    + "\n".join(sorted(map(str, lines))) + f"\n{sorted(routes)}")
                bypass_checked += 1
            res = redirect.setup(pod.name, POOL[target], backend=backend)
            assert redirect.check(pod.name, POOL[target], backend=backend).ok
            after = our_lines(pod.name, backend)
            assert any(after == known.lines[key] for key in known.lines if key[0] == target)
            assert our_routes(pod) == known.routes[target]
            del res
            cur = target
        assert bypass_checked >= 10
        print(f"{backend}: {kills} kills, {bypass_checked} probed, seed {seed}, span {span * 1e3:.1f} ms,"
              f" in {time.monotonic() - t_start:.1f} s")
    redirect.teardown(pod.name, backend=backend)


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy"])
def test_a_failure_once_the_new_rules_are_in_keeps_them_and_says_so(
        pod: Pod, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = RedirectConfig(outbound_exclude_ports=(9090,)), RedirectConfig(inbound_interception="TPROXY")
    redirect.setup(pod.name, old, backend=backend)
    monkeypatch.setenv("REDIRECT_FAULT", "iptables.remove_v4")
    with pytest.raises(redirect.SetupError, match="after the new rules were in.*run setup again"):
        redirect.setup(pod.name, new, backend=backend)
    monkeypatch.delenv("REDIRECT_FAULT")
    assert generations(our_lines(pod.name, backend)) == {"RDR_", "RDR2_"}
    res = redirect.check(pod.name, new, backend=backend)
    assert not res.ok and res.differences[0].startswith("interrupted setup"), res.differences
    assert redirect.setup(pod.name, new, backend=backend).changed
    assert redirect.check(pod.name, new, backend=backend).ok
    assert generations(our_lines(pod.name, backend)) == {"RDR2_"}
    redirect.teardown(pod.name, backend=backend)
    assert not our_lines(pod.name, backend)


#: The eBPF backend's configs, each capturing another set of the probes (an ambient one among
#: them: its policy route comes and goes with it).
EBPF_POOL = [
    RedirectConfig(),
    RedirectConfig(outbound_exclude_ports=(9090,)),
    RedirectConfig(inbound_ports=(8000,), outbound_exclude_cidrs=("10.0.0.0/8",)),
    RedirectConfig(ipv6=False),
    RedirectConfig(outbound_ports=(9090,), outbound_cidrs=()),
    RedirectConfig(mode="ambient", bypass_inbound_capture=True),
]



def test_an_ebpf_change_killed_just_before_its_policy_still_captures_all_the_old_config_does(
        pod: Pod, ebpf_root: str) -> None:
    """Every change between two configs, killed at its widest window (everything but the policy
    written): the pod captures exactly what the old config captures (the new entries are in the
    generation the live policy does not read), and the next setup repairs it."""
    with probes_for(pod) as probes, subreaper():
        captures = {}
        for i, cfg in enumerate(EBPF_POOL):
            redirect.setup(pod.name, cfg, backend="ebpf")
            captures[i] = probes.captured()
        for i, old in enumerate(EBPF_POOL):
            for j, new in enumerate(EBPF_POOL):
                if i == j:
                    continue
                redirect.setup(pod.name, old, backend="ebpf")
                killed_setup(pod.name, new, "ebpf", 0.0, point="ebpf.before_policy")
                assert probes.captured() == captures[i], f"killed from config {i} to {j}"
                redirect.setup(pod.name, new, backend="ebpf")
                assert redirect.check(pod.name, new, backend="ebpf").ok
                assert probes.captured() == captures[j]
        redirect.teardown(pod.name, backend="ebpf")
    from tests.test_ebpf import _cookie, entries_mentioning

    assert not any(entries_mentioning(ebpf_root, _cookie(pod)).values())


def test_an_ebpf_setup_killed_anywhere_leaves_no_bypass_and_is_repaired(pod: Pod, ebpf_root: str) -> None:
    """The eBPF backend's general path (a pod set up before): its state is map entries, read back
    by probing only: after each kill the probes captured include all those of one of the two configs."""
    seed = int(os.environ.get("REDIRECT_KILL_SEED") or int.from_bytes(os.urandom(4), "big"))
    rnd = random.Random(seed)
    with probes_for(pod) as probes, subreaper():
        captures = {}
        for i, cfg in enumerate(EBPF_POOL):
            redirect.setup(pod.name, cfg, backend="ebpf")
            captures[i] = probes.captured()
        assert len(set(captures.values())) == len(EBPF_POOL)  # each config captures something else
        span = sorted(timed_setup(pod.name, EBPF_POOL[j], "ebpf") for j in (0, 1, 2))[1] * 1.3
        cur = 2
        for k in range(100):
            target = rnd.choice([j for j in range(len(EBPF_POOL)) if j != cur])
            killed_setup(pod.name, EBPF_POOL[target], "ebpf", rnd.uniform(0, span))
            got = probes.landings()
            caught = {p for p, label in got.items() if label == "proxy"}
            assert captures[cur] <= caught or captures[target] <= caught, (
                f"bypass after kill {k} (seed {seed}) from config {cur} to {target}: {got}")
            redirect.setup(pod.name, EBPF_POOL[target], backend="ebpf")
            assert redirect.check(pod.name, EBPF_POOL[target], backend="ebpf").ok
            cur = target
        redirect.teardown(pod.name, backend="ebpf")
    # Nothing of the pod is left in any map, the entries of interrupted writes included.
    from tests.test_ebpf import _cookie, entries_mentioning

    assert not any(entries_mentioning(ebpf_root, _cookie(pod)).values())


def test_an_ebpf_change_to_or_from_ambient_killed_before_its_entries_is_repaired(pod: Pod, ebpf_root: str) -> None:
    """The ambient policy route is added before the entries and the policy: a setup killed there
    leaves the route under the old config's policy; the next setup of either config makes the
    routes its own, and check agrees."""
    from tests.test_ambient import snapshot

    before = snapshot(pod.name)
    sidecar, amb = RedirectConfig(), RedirectConfig(mode="ambient")
    with subreaper():
        for old, new in ((sidecar, amb), (amb, sidecar)):
            for again in (old, new):
                redirect.setup(pod.name, old, backend="ebpf")
                killed_setup(pod.name, new, "ebpf", 0.0, point="ebpf.before_entries")
                redirect.setup(pod.name, again, backend="ebpf")
                res = redirect.check(pod.name, again, backend="ebpf")
                assert res.ok, (old.mode, new.mode, again.mode, res.differences)
        # Killed on a fresh pod (no policy yet): the eBPF teardown takes the route too.
        assert redirect.teardown(pod.name, backend="ebpf")
        killed_setup(pod.name, amb, "ebpf", 0.0, point="ebpf.before_entries")
        assert "lookup 100" in snapshot(pod.name)["rule4"]
        redirect.teardown(pod.name, backend="ebpf")
    assert snapshot(pod.name) == before


def test_an_ebpf_ambient_setup_killed_before_turning_tcp_fwmark_accept_on_captures_and_is_repaired(
        pod: Pod, ebpf_root: str) -> None:
    """``tcp_fwmark_accept`` is turned on after the policy, which records it as ours: a setup killed
    between the two (a fresh pod's one call; a change to ambient on the general path) leaves the pod
    capturing what ambient captures, check names the sysctl, the next setup turns it on, and
    teardown gives the netns back as it was."""
    from tests.test_ambient import snapshot

    before = snapshot(pod.name)
    amb = RedirectConfig(mode="ambient")
    with probes_for(pod) as probes, subreaper():
        redirect.setup(pod.name, amb, backend="ebpf")
        want = probes.captured()
        assert want and redirect.teardown(pod.name, backend="ebpf")
        for old in (None, RedirectConfig(mode="ambient", bypass_inbound_capture=True)):
            if old is not None:
                redirect.setup(pod.name, old, backend="ebpf")
            killed_setup(pod.name, amb, "ebpf", 0.0, point="ebpf.before_fwmark_accept")
            assert want <= probes.captured(), old
            res = redirect.check(pod.name, amb, backend="ebpf")
            assert not res.ok and any("tcp_fwmark_accept" in d for d in res.differences), res.differences
            assert "tcp_fwmark_accept = 0" in snapshot(pod.name)["sysctl"]
            redirect.setup(pod.name, amb, backend="ebpf")
            assert redirect.check(pod.name, amb, backend="ebpf").ok
            assert "tcp_fwmark_accept = 1" in snapshot(pod.name)["sysctl"]
            assert redirect.teardown(pod.name, backend="ebpf")
            assert snapshot(pod.name) == before
