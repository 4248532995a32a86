"""The host's own network namespace is refused; the netns lock lives where only root can reach
it; the CNI plugin's log file is private and one JSON object per line.

Only refusals touch the host: every accepted setup is in a test netns (the override is shown
from a process whose own netns is a test pod's), torn down in ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import redirect
from redirect.config import RedirectConfig
from redirect.errors import HostNetnsError, NetnsError, SetupError
from redirect.kernel import locks
from redirect.kernel import netns as rnetns
from tests.netkit import Pod

NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
CLI = [sys.executable, "-m", "redirect.cli"]


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload, no-any-return]


def host_capture() -> str:
    """Sidecar capture of ours in the host netns, as the kernel lists it: our chains (not the
    node rules' ``RDR_NODE_*``) in either iptables variant, our nftables table."""
    text = ""
    for tool in ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save"):
        text += run([tool]).stdout
    text += run(["nft", "list", "tables"]).stdout
    return "\n".join(ln for ln in text.splitlines()
                     if ("RDR_" in ln and "RDR_NODE" not in ln) or "rdr_redirect" in ln)


# --- the host's netns ------------------------------------------------------------------------



HOST_FORMS = ["/proc/self/ns/net", "../../proc/self/ns/net", "/proc/thread-self/ns/net", "pid:SELF", "pid:1",
              "/proc/1/ns/net"]


@pytest.mark.parametrize("backend", ["iptables", "nftables", "ebpf"])
def test_setup_refuses_the_host_netns_in_every_form(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    if backend == "ebpf":
        request.getfixturevalue("ebpf_root")
    monkeypatch.chdir("/")  # the relative form leads to /proc from there
    before = host_capture()
    for form in HOST_FORMS:
        ref = form.replace("SELF", str(os.getpid()))
        # (pid 1's netns may be unreadable even to root in a sandbox: refused as unopenable then)
        with pytest.raises(NetnsError) as e:
            redirect.setup(ref, RedirectConfig(), backend=backend)
        if os.access(rnetns.path_of(ref) or "", os.R_OK):
            assert isinstance(e.value, HostNetnsError), (ref, e.value)
            assert "host" in str(e.value) and "--allow-host-netns" in str(e.value)
    assert host_capture() == before
    if backend == "ebpf":
        from redirect.backends import ebpf

        assert ebpf.registered_pods() == []


def test_cli_refuses_the_host_netns_and_a_bare_number_is_a_name() -> None:
    before = host_capture()
    p = run([*CLI, "setup", "/proc/self/ns/net"])
    assert p.returncode == 1 and "network namespace" in p.stderr and "--allow-host-netns" in p.stderr, p.stderr
    p = run([*CLI, "init", "-p", "15001"])  # istio-iptables' way: its own netns, which is the host's here
    assert p.returncode == 1 and "host" in p.stderr, p.stderr
    p = run([*CLI, "setup", "1"])
    assert p.returncode == 1 and "/run/netns/1 does not exist" in p.stderr, p.stderr
    assert "pid:N" in run([*CLI, "setup", "--help"]).stdout
    assert host_capture() == before


def test_cni_add_naming_the_host_netns_fails_with_bad_environment() -> None:
    plugin = os.path.join(os.path.dirname(sys.executable), "redirect-cni")
    conf = {"cniVersion": "1.0.0", "name": "rdrt-test", "type": "redirect-cni",
            "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.250.0.2/24"}]}}
    env = {"PATH": os.environ.get("PATH", ""), "CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1",
           "CNI_NETNS": "/proc/self/ns/net", "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni"}
    before = host_capture()
    p = subprocess.run([plugin], input=json.dumps(conf).encode(), env=env, capture_output=True, timeout=60)
    out = json.loads(p.stdout)
    assert p.returncode != 0 and out["code"] == 7 and "network namespace" in out["msg"], out
    assert host_capture() == before


def test_agent_refuses_an_event_naming_the_host_netns(tmp_path: Path) -> None:
    from redirect.ambient.agent import client
    from tests.test_agent import Node, record_of

    n = Node(tmp_path)
    try:
        n.start_agent()
        assert n.agent is not None
        before = host_capture()
        for ref in ("/proc/self/ns/net", f"/proc/{n.agent.proc.pid}/ns/net"):  # (the agent's own: the host's)
            with pytest.raises(client.AgentError, match="network namespace") as e:
                client.add_pod(n.events, uid="u-host", netns=ref, config={"mode": "ambient"})
            assert e.value.reason == "netns"
        assert host_capture() == before and record_of("/proc/self/ns/net") is None
    finally:
        n.close()


def test_the_override_and_redirect_init_in_a_pods_own_netns(pod: Pod) -> None:
    """A process whose own netns is the pod's: its own netns is refused, allowed with
    --allow-host-netns (here that is the pod's, not the host's); ``redirect init`` without a netns
    installs there as istio-iptables does."""
    in_pod = ["ip", "netns", "exec", pod.name, *CLI]
    try:
        p = run([*in_pod, "setup", "/proc/self/ns/net"])
        assert p.returncode == 1 and "caller's own" in p.stderr, p.stderr
        assert not redirect.show(pod.name)["installed"]
        p = run([*in_pod, "setup", "/proc/self/ns/net", "--allow-host-netns"])
        assert p.returncode == 0, p.stderr
        assert redirect.show(pod.name)["installed"]
        assert redirect.teardown(pod.name)
        p = run([*in_pod, "init", "-p", "15001"])
        assert p.returncode == 0, p.stderr
        assert redirect.show(pod.name)["installed"]
    finally:
        redirect.teardown(pod.name)


def test_pid_form_names_a_process_netns(pod: Pod) -> None:
    proc = subprocess.Popen(["ip", "netns", "exec", pod.name, "sleep", "30"])
    try:
        want = rnetns.netns_inode(pod.name)
        for _ in range(200):  # until it has entered the pod's netns (bounded: ~2 s)
            try:
                if os.stat(f"/proc/{proc.pid}/ns/net").st_ino == want:
                    break
            except OSError:
                pass
            subprocess.run(["sleep", "0.01"])
        ref = f"pid:{proc.pid}"
        assert rnetns.netns_inode(ref) == want
        assert redirect.setup(ref, RedirectConfig()).changed
        assert redirect.show(pod.name)["installed"]
        assert redirect.teardown(ref)
    finally:
        proc.kill()
        proc.wait()
        redirect.teardown(pod.name)
    for bad in ("pid:", "pid:x", "pid:-1", "pid:١٢"):
        with pytest.raises(NetnsError, match="pid:<process id>"):
            redirect.setup(bad, RedirectConfig())


# --- the lock's directory --------------------------------------------------------------------


@pytest.fixture
def run_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """``run_dir(path)``: this thread's locks go to ``path`` (REDIRECT_RUN_DIR) from now on."""

    def use(path: str) -> None:
        monkeypatch.setenv("REDIRECT_RUN_DIR", path)
        locks.forget_thread_lock_fd()

    yield use
    monkeypatch.delenv("REDIRECT_RUN_DIR", raising=False)
    locks.forget_thread_lock_fd()


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A directory anyone may create entries in (sticky, like /run/lock or /tmp)."""
    d = tempfile.mkdtemp(prefix="rdrt-locks-", dir="/tmp")
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", d], check=True)


def refused(pod: Pod, backend: str = "iptables") -> str:
    with pytest.raises(SetupError) as e:
        redirect.setup(pod.name, RedirectConfig(), backend=backend)
    assert not redirect.show(pod.name)["installed"]
    return str(e.value)


def test_run_dir_is_made_0700_and_the_lock_0600(pod: Pod, run_dir: Callable[[str], None], shared_tmp: str) -> None:
    path = os.path.join(shared_tmp, "made", "run")
    run_dir(path)
    try:
        assert redirect.setup(pod.name, RedirectConfig()).changed
    finally:
        redirect.teardown(pod.name)
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0
    st = os.lstat(os.path.join(path, locks.NETNS_LOCK))
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0


def test_a_plain_user_cannot_plant_anything_in_the_run_dir(pod: Pod) -> None:
    os.close(locks.open_run_dir())  # the real one, made if missing
    d = locks.run_dir_path()
    for argv in (["touch", f"{d}/{locks.NETNS_LOCK}"], ["ln", "-s", "/tmp/elsewhere", f"{d}/planted"],
                 [sys.executable, "-c", f"import os; os.open({d + '/' + locks.NETNS_LOCK!r}, os.O_RDONLY)"]):
        p = run([*NOBODY, *argv])
        assert p.returncode != 0 and "ermission denied" in p.stderr, (argv, p.stderr)
    assert not os.path.lexists(f"{d}/planted")
    try:
        assert redirect.setup(pod.name, RedirectConfig()).changed
    finally:
        redirect.teardown(pod.name)


@pytest.mark.parametrize("backend", ["iptables", "ebpf"])
def test_a_run_dir_a_plain_user_made_or_linked_is_refused(
    pod: Pod, run_dir: Callable[[str], None], shared_tmp: str, backend: str
) -> None:
    # (the eBPF one-call path takes the same lock: refused before it loads anything)
    path, target = os.path.join(shared_tmp, "run"), os.path.join(shared_tmp, "target")
    run_dir(path)
    assert run([*NOBODY, "mkdir", "-m", "700", path]).returncode == 0
    msg = refused(pod, backend)
    assert path in msg and "owned by uid 65534" in msg
    os.rmdir(path)
    assert run([*NOBODY, "mkdir", target]).returncode == 0
    assert run([*NOBODY, "ln", "-s", target, path]).returncode == 0
    msg = refused(pod, backend)
    assert path in msg and "symlink" in msg
    assert os.listdir(target) == []


def test_a_run_dir_others_may_write_or_a_planted_lock_file_is_refused(
    pod: Pod, run_dir: Callable[[str], None], shared_tmp: str
) -> None:
    path = os.path.join(shared_tmp, "run")
    os.mkdir(path)
    run_dir(path)
    os.chmod(path, 0o777)
    msg = refused(pod)
    assert path in msg and "mode 0777" in msg
    os.chmod(path, 0o700)
    lock = os.path.join(path, locks.NETNS_LOCK)
    os.symlink(os.path.join(shared_tmp, "elsewhere"), lock)
    msg = refused(pod)
    assert lock in msg and "symlink" in msg and not os.path.exists(os.path.join(shared_tmp, "elsewhere"))
    os.unlink(lock)
    with open(lock, "w"):
        pass
    os.chown(lock, 65534, 65534)
    os.chmod(lock, 0o600)
    msg = refused(pod)
    assert lock in msg and "owned by uid 65534" in msg
    os.chown(lock, 0, 0)
    os.chmod(lock, 0o644)
    msg = refused(pod)
    assert lock in msg and "mode 0644" in msg


def test_no_fallback_when_the_run_dir_cannot_be_made(pod: Pod, run_dir: Callable[[str], None]) -> None:
    run_dir("/proc/rdrt-no-such-dir/run")  # (procfs: nothing can be created there)
    msg = refused(pod)
    assert "/proc/rdrt-no-such-dir/run" in msg and "cannot be created" in msg


# --- the CNI plugin's log file ---------------------------------------------------------------


def cni_del(log_file: str, container: str, log_json: bool = True) -> subprocess.CompletedProcess[bytes]:
    plugin = os.path.join(os.path.dirname(sys.executable), "redirect-cni")
    conf = {"cniVersion": "1.0.0", "name": "rdrt-test", "type": "redirect-cni", "logFile": log_file,
            "logLevel": "info", "logJson": log_json}
    env = {"PATH": os.environ.get("PATH", ""), "CNI_COMMAND": "DEL", "CNI_CONTAINERID": container,
           "CNI_NETNS": "", "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni"}
    return subprocess.run([plugin], input=json.dumps(conf).encode(), env=env, capture_output=True, timeout=60)


FORGED = '{"level": "error", "msg": "forged"}'


def test_cni_log_file_is_private_and_a_container_id_cannot_forge_a_line(shared_tmp: str) -> None:
    log_file = os.path.join(shared_tmp, "cni.log")
    assert cni_del(log_file, "c1\n" + FORGED).returncode == 0
    assert stat.S_IMODE(os.stat(log_file).st_mode) == 0o600
    with open(log_file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    records = [json.loads(ln) for ln in lines]  # every line is one object
    assert FORGED not in lines
    assert any("c1\n" + FORGED in r["msg"] for r in records), records
    assert all({"time", "level", "logger", "msg"} <= set(r) for r in records)

    # Text lines (logJson false) escape it too.
    text_file = os.path.join(shared_tmp, "cni.txt")
    assert cni_del(text_file, "c1\n" + FORGED, log_json=False).returncode == 0
    with open(text_file, encoding="utf-8") as f:
        text = f.read()
    assert "c1\\x0a" + FORGED in text and not any(ln.startswith(FORGED) for ln in text.splitlines()), text

    # An existing log readable by others is made private; a symlink is never followed.
    os.chmod(log_file, 0o644)
    assert cni_del(log_file, "c2").returncode == 0
    assert stat.S_IMODE(os.stat(log_file).st_mode) == 0o600
    victim = os.path.join(shared_tmp, "victim")
    with open(victim, "w") as f:
        f.write("untouched\n")
    link = os.path.join(shared_tmp, "link.log")
    os.symlink(victim, link)
    p = cni_del(link, "c3")
    assert p.returncode == 0 and b"cannot use the logFile" in p.stderr, p.stderr
    with open(victim) as f:
        assert f.read() == "untouched\n"


# --- every entry point that changes a netns, on a node -----------------------------------------
#
# A netns stands for the node: sidecar capture of ours is put there from outside (where it is a
# pod's), then each entry point runs *inside* it, where it is the caller's own netns (the host's,
# as on a node), and must leave that capture alone.


def in_node(node: str, *argv: str, env: dict[str, str] | None = None,
            stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["nsenter", f"--net=/run/netns/{node}", "--", *argv], input=stdin, capture_output=True,
                          timeout=60, env=env)


def cni_in_node(node: str, exe: str, command: str, conf: dict[str, object],
                netns: str) -> tuple[int, dict[str, object]]:
    env = {"PATH": os.environ.get("PATH", ""), "CNI_COMMAND": command, "CNI_CONTAINERID": "c-host",
           "CNI_NETNS": netns, "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni", "CNI_ARGS": "K8S_POD_UID=u-host"}
    p = in_node(node, exe, env=env, stdin=json.dumps(conf).encode())
    return p.returncode, json.loads(p.stdout)


def capture_in(ns: str) -> str:
    """Our capture in ``ns`` as the kernel lists it (what a refused entry point must leave): the
    rules and chains of ``iptables-save``, without its comment lines (a timestamp) and counters."""
    text = subprocess.run(["ip", "netns", "exec", ns, "iptables-save"], capture_output=True, text=True,
                          check=True).stdout
    return "|".join(re.sub(r"\[\d+:\d+\]", "", ln) for ln in text.splitlines() if not ln.startswith("#"))


def test_teardown_refuses_the_host_netns_in_every_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/")
    before = host_capture()
    for form in HOST_FORMS:
        ref = form.replace("SELF", str(os.getpid()))
        with pytest.raises(NetnsError) as e:
            redirect.teardown(ref)
        if os.access(rnetns.path_of(ref) or "", os.R_OK):
            assert isinstance(e.value, HostNetnsError) and "--allow-host-netns" in str(e.value), (ref, e.value)
    assert host_capture() == before
    p = run([*CLI, "init", "--cleanup-only"])  # its own netns, the host's here
    assert p.returncode == 1 and "host" in p.stderr and "removed" not in p.stdout, (p.stdout, p.stderr)


def test_cli_teardown_and_init_cleanup_refuse_their_own_netns_on_a_node(pod: Pod) -> None:
    node = pod.name
    redirect.setup(node, RedirectConfig())
    ours = capture_in(node)
    assert "RDR_OUTPUT" in ours
    for argv in (["teardown", "/proc/self/ns/net"], ["teardown", "/proc/self/ns/net", "--backend", "iptables"],
                 ["init", "--cleanup-only", "--network-namespace", "/proc/self/ns/net"]):
        p = in_node(node, *CLI, *argv)
        assert p.returncode == 1 and b"caller's own" in p.stderr and b"--allow-host-netns" in p.stderr, (argv, p)
        assert capture_in(node) == ours
    p = in_node(node, sys.executable, "-c", "import redirect; redirect.teardown('/proc/self/ns/net')")
    assert p.returncode == 1 and b"HostNetnsError" in p.stderr, p.stderr
    assert capture_in(node) == ours
    p = in_node(node, *CLI, "teardown", "/proc/self/ns/net", "--allow-host-netns")  # the escape, as for setup
    assert p.returncode == 0 and b"removed" in p.stdout, p
    assert not redirect.show(node)["installed"]


@pytest.mark.parametrize("mode", ["sidecar", "ambient"])
def test_python_cni_del_of_its_own_netns_on_a_node_fails_7_and_removes_nothing(pod: Pod, tmp_path: Path,
                                                                               mode: str) -> None:
    node = pod.name
    redirect.setup(node, RedirectConfig())
    ours = capture_in(node)
    conf: dict[str, object] = {"cniVersion": "1.0.0", "name": "rdrt-test", "type": "redirect-cni", "mode": mode,
                               "agentSocket": str(tmp_path / "no-agent.sock")}  # ambient: falls back in-process
    plugin = os.path.join(os.path.dirname(sys.executable), "redirect-cni")
    rc, out = cni_in_node(node, plugin, "DEL", conf, "/proc/self/ns/net")
    assert rc == 1 and out["code"] == 7 and "network namespace" in str(out["msg"]), out
    assert capture_in(node) == ours


@pytest.mark.parametrize("mode", ["sidecar", "ambient"])
def test_the_agent_refuses_a_del_of_its_own_netns_on_a_node(pod: Pod, tmp_path: Path, mode: str) -> None:
    """The agent runs in the node's netns (hostNetwork): an events ``del`` and a thin plugin DEL
    naming that netns (``/proc/self/ns/net`` resolves in the agent) are refused, 7 for the DEL."""
    from redirect.ambient.agent import client
    from redirect.cni import install as inst
    from tests.test_agent import Node

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    inst.install_binary(str(bin_dir))
    n = Node(tmp_path)
    try:
        redirect.setup(n.ns, RedirectConfig())
        ours = capture_in(n.ns)
        agent = n.start_agent("--no-host-rules", inside=True)
        for ref in ("/proc/self/ns/net", f"/proc/{agent.proc.pid}/ns/net"):
            with pytest.raises(client.AgentError, match="network namespace") as e:
                client.del_pod(n.events, uid="u-host", netns=ref)
            assert e.value.reason == "netns"
            assert capture_in(n.ns) == ours
        conf: dict[str, object] = {"cniVersion": "1.0.0", "name": "rdrt-test", "type": "redirect-cni", "mode": mode,
                                   "agentSocket": n.events}
        rc, out = cni_in_node(n.name, str(bin_dir / "redirect-cni"), "DEL", conf, "/proc/self/ns/net")
        assert rc == 1 and out["code"] == 7 and "network namespace" in str(out["msg"]), out
        assert capture_in(n.ns) == ours
        assert agent.proc.poll() is None
    finally:
        with contextlib.suppress(Exception):
            redirect.teardown(n.ns)
        n.close()
