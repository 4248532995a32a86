"""The thin CNI plugin (native/cni_thin.c) driven as a runtime drives it, with a real redirect-agent.

The plugin is installed into a bin dir of the test's own by ``redirect.cni.install`` (the thin
binary as ``redirect-cni``, the Python plugin's launcher as ``redirect-cni-python``) and exec'd
with CNI env vars and a config on stdin; the agent runs as a process on a socket in a temp dir,
serving sidecar pods in-process with the configured backend and ambient pods for a node proxy.
Traffic is real and asserted captured after ADD and not after DEL.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import redirect
from redirect.cni import install as inst
from redirect.cni.netconf import MAX_STDIN, convert_result, encode_annotations
from tests import netkit
from tests.ctrkit import (  # the containerd kit
    Containerd,
    bridge_net,
    containerd,  # noqa: F401 - the fixture
    ctr_run,
    needs_containerd,
    wait_task,
)
from tests.netkit import Pod, TcpListener, landing
from tests.test_agent import Node, read_log, wait_log

pytestmark = pytest.mark.timeout(180)

PYTHON_PLUGIN = os.path.join(os.path.dirname(sys.executable), "redirect-cni")
PREV = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "x"}],
        "ips": [{"address": "10.250.0.2/24", "interface": 0}], "dns": {}}
T = "traffic.sidecar.istio.io/"


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("cni-bin"))
    inst.install_binary(d)
    return d


def netconf(sock: str, version: str = "1.0.0", prev: dict[str, Any] | None = PREV, **ours: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {"cniVersion": version, "name": "rdrt-thin", "type": "redirect-cni",
                            "agentSocket": sock, **ours}
    if prev is not None:
        conf["prevResult"] = convert_result(prev, version)
    return conf


def run_plugin(exe: str, command: str, conf: dict[str, Any] | bytes, netns: str = "", args: str = "",
               container: str = "ctr1", env: dict[str, str] | None = None) -> tuple[int, dict[str, Any] | None]:
    e = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CNI_COMMAND": command,
         "CNI_CONTAINERID": container, "CNI_NETNS": netns, "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni",
         "CNI_ARGS": args, **(env or {})}
    data = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    p = subprocess.run([exe], input=data, env=e, capture_output=True, timeout=60)
    out = json.loads(p.stdout) if p.stdout.strip() else None
    return p.returncode, out


class Thin:
    """The thin plugin in ``bin_dir``, talking to the agent of ``node``."""

    def __init__(self, bin_dir: str, node: Node) -> None:
        self.exe = os.path.join(bin_dir, "redirect-cni")
        self.node = node

    def __call__(self, command: str, conf: dict[str, Any] | bytes, netns: str = "", **kw: Any) -> tuple[
            int, dict[str, Any] | None]:
        return run_plugin(self.exe, command, conf, netns, **kw)


@contextlib.contextmanager
def agent_node(tmp: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """A test node whose agent serves CNI requests; eBPF host programs in a scratch bpffs root."""
    root = f"/sys/fs/bpf/rdrt-thin-{os.getpid()}-{os.urandom(2).hex()}"
    if backend == "ebpf":
        monkeypatch.setenv("REDIRECT_BPF_ROOT", root)  # inherited by the agent
    n = Node(tmp, backend)
    try:
        yield n
    finally:
        n.close()
        if backend == "ebpf":
            from redirect.backends import ebpf

            ebpf.force_unload_host(root)
            assert not os.path.exists(root)


def captured(pod: Pod, backend: str) -> bool:
    """Outbound traffic of the pod lands on its proxy port (15001), not on the app behind it."""
    with TcpListener(pod.name, 15001, label="proxy") as proxy, TcpListener(pod.peer_name, 8080, label="app") as app:
        hit = landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=1000)
        return hit.label == "proxy"


def installed(pod: Pod, backend: str) -> bool:
    shown = redirect.show(pod.name, backend=backend)
    return bool(shown["installed"])


# --- without an agent ------------------------------------------------------------------------


def test_version_is_answered_locally(bin_dir: str) -> None:
    exe = os.path.join(bin_dir, "redirect-cni")
    assert run_plugin(exe, "VERSION", {"cniVersion": "0.4.0"}) == run_plugin(PYTHON_PLUGIN, "VERSION",
                                                                             {"cniVersion": "0.4.0"})
    rc, out = run_plugin(exe, "VERSION", b"")
    assert rc == 0 and out == {"cniVersion": "1.1.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0",
                                                                          "1.1.0"]}


@pytest.mark.parametrize("command", ["ADD", "DEL", "VERSION", "BOGUS"])
def test_a_closed_or_oversized_stdin_gets_6_from_both_plugins(bin_dir: str, command: str) -> None:
    """Stdin closed (``<&-``): 6, "cannot read the network config on stdin", not a traceback; over
    1 MiB: 6, whatever the command (VERSION included), from both plugins."""
    answers = []
    for exe in (os.path.join(bin_dir, "redirect-cni"), PYTHON_PLUGIN):
        env = {"PATH": os.environ["PATH"], "CNI_COMMAND": command, "CNI_NETNS": "/run/netns/rdrt-none"}
        p = subprocess.run([exe], stdin=subprocess.DEVNULL, env=env, capture_output=True, timeout=30,
                           preexec_fn=lambda: os.close(0))
        assert b"Traceback" not in p.stderr, p.stderr.decode()[-2000:]
        assert p.returncode == 1 and json.loads(p.stdout)["code"] == 6, p.stdout
        assert json.loads(p.stdout)["msg"] == "cannot read the network config on stdin", p.stdout
        answers.append(json.loads(p.stdout))
        rc, out = run_plugin(exe, command, b'{"cniVersion": "0.4.0"}' + b" " * MAX_STDIN)
        assert rc == 1 and out is not None and out["code"] == 6 and "larger than" in out["msg"], out
    assert answers[0] == answers[1]


HOSTILE = {
    "truncated": b'{"cniVersion": "1.0.0", "name": "x", "plugins": [{"a": ',
    "not-utf8": b'{"cniVersion": "1.0.0", "name": "\xff\xfe"}',
    "not-an-object": b'["cniVersion", "1.0.0"]',
    "garbage": b"\x00\x01\x02 not json",
    "trailing": b'{"cniVersion": "1.0.0"} {}',
    "huge": b'{"cniVersion": "1.0.0", "pad": "' + b"a" * (MAX_STDIN + 10) + b'"}',
    "bad-escape": b'{"cniVersion": "1.0.0", "name": "\\x41"}',
    "blank": b" \n\t ",  # (an empty stdin reads as {}, a blank one is not JSON)
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_stdin_gets_the_python_plugins_code(bin_dir: str, kind: str, tmp_path: Path) -> None:
    """Bad stdin never reaches the agent (none runs here) and gets the code the Python plugin gives."""
    exe = os.path.join(bin_dir, "redirect-cni")
    rc, out = run_plugin(exe, "ADD", HOSTILE[kind], "/proc/self/ns/net")
    assert rc == 1 and out is not None and set(out) == {"cniVersion", "code", "msg", "details"}, out
    prc, pout = run_plugin(PYTHON_PLUGIN, "ADD", HOSTILE[kind], "/proc/self/ns/net")
    assert (rc, out["code"]) == (prc, pout["code"] if pout else None) == (1, 6)


def _deep(levels: int, top_object: bool = True) -> bytes:
    """A config whose objects and arrays nest ``levels`` deep, the top-level value included."""
    if not top_object:
        return b"[" * levels + b"]" * levels
    return NO_AGENT[:-1] + b', "x": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"


#: a config the thin plugin hands to the Python plugin (no agent: inProcess)
NO_AGENT = b'{"cniVersion": "1.1.0", "name": "n", "agentSocket": "/run/rdrt-no-agent.sock", "agentDown": "inProcess"}'

STRICT = {  # what RFC 8259 refuses, and what it takes, as values of a config member
    **{f"bad-{k}": (v, 6) for k, v in {"word": "foo", "leading-zero": "01", "plus": "+1", "half-true": "tru",
                                        "exponent": "1e", "dot": "1.", "dot-first": ".5", "minus": "-",
                                        "hex": "0x10", "nan": "NaN", "infinity": "Infinity",
                                        "minus-infinity": "-Infinity", "true-ish": "truex", "caps": "True",
                                        "single-quotes": "'a'"}.items()},
    **{f"ok-{k}": (v, 0) for k, v in {"zero": "0", "minus-zero": "-0", "fraction": "-0.5e+3", "exp": "1E-2",
                                       "true": "true", "null": "null", "big": "1e400"}.items()},
}


@pytest.mark.parametrize("kind", sorted(STRICT))
def test_both_plugins_decode_strict_json(bin_dir: str, kind: str) -> None:
    """Strict JSON, the same in both plugins: bare words, odd numbers, NaN and Infinity are 6."""
    value, code = STRICT[kind]
    # no agent: the thin plugin answers 11 (tryAgain) for what it takes, or hands it on (inProcess)
    head = NO_AGENT if code == 0 else NO_AGENT.replace(b"inProcess", b"tryAgain")
    data = head[:-1] + b', "x": [' + value.encode() + b"]}"
    for exe in (os.path.join(bin_dir, "redirect-cni"), PYTHON_PLUGIN):
        rc, out = run_plugin(exe, "GC", data)
        assert (rc, out and out["code"]) == ((1, 6) if code else (0, None)), (exe, out)


@pytest.mark.parametrize("levels,top_object", [(512, True), (513, True), (900, True), (512, False), (513, False)])
def test_nesting_has_one_bound_of_512_levels_in_both_plugins(bin_dir: str, levels: int, top_object: bool) -> None:
    """512 levels of objects and arrays, the top-level value's included, are taken by both plugins;
    513 are 6 from both (Python's decoder alone took up to about a thousand)."""
    data = _deep(levels, top_object)
    want = 6 if levels > 512 or not top_object else 0
    for exe in (os.path.join(bin_dir, "redirect-cni"), PYTHON_PLUGIN):
        rc, out = run_plugin(exe, "GC", data)
        if want:
            assert rc == 1 and out is not None and out["code"] == 6, (exe, out)
            assert "nested deeper than 512" in out["details"] or not top_object, (exe, out)
        else:
            assert (rc, out) == (0, None), (exe, out)


def test_deep_nesting_and_bad_env_are_refused(bin_dir: str) -> None:
    exe = os.path.join(bin_dir, "redirect-cni")
    deep = b'{"cniVersion": "1.0.0", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    rc, out = run_plugin(exe, "ADD", deep, "/proc/self/ns/net")
    assert rc == 1 and out is not None and out["code"] == 6 and "nested" in out["details"], out
    for command in ("BOGUS", ""):
        rc, out = run_plugin(exe, command, {"cniVersion": "1.0.0"})
        assert rc == 1 and out is not None and out["code"] == 7, out
    rc, out = run_plugin(exe, "ADD", {"cniVersion": "1.0.0"}, "/proc/self/ns/net", args="A=" + "x" * 40_000)
    assert rc == 1 and out is not None and out["code"] == 7 and "CNI_ARGS" in out["msg"], out
    p = subprocess.run([exe], input=b"{}", env={"PATH": "/usr/bin"}, capture_output=True, timeout=10)
    assert p.returncode == 1 and json.loads(p.stdout)["code"] == 7


def test_agent_down_tries_again_or_falls_back_to_the_python_plugin(bin_dir: str, pod: Pod,
                                                                    tmp_path: Path) -> None:
    exe = os.path.join(bin_dir, "redirect-cni")
    sock = str(tmp_path / "no-agent.sock")
    rc, out = run_plugin(exe, "ADD", netconf(sock), pod.path)
    assert rc == 1 and out is not None and out["code"] == 11 and sock in out["details"], out
    assert not installed(pod, "iptables")
    rc, out = run_plugin(exe, "STATUS", netconf(sock, "1.1.0"))
    assert rc == 1 and out is not None and out["code"] == 50, out  # the runtime starts no pods meanwhile
    # A socket file whose agent died (SIGKILL leaves it behind): the same.
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(sock)
    rc, out = run_plugin(exe, "ADD", netconf(sock, agentDown="tryAgain"), pod.path)
    assert rc == 1 and out is not None and out["code"] == 11, out
    assert not installed(pod, "iptables")
    # inProcess: the Python plugin next to the binary does the work.
    conf = netconf(sock, agentDown="inProcess")
    rc, out = run_plugin(exe, "ADD", conf, pod.path)
    assert (rc, out) == (0, PREV)
    assert captured(pod, "iptables")
    assert run_plugin(exe, "CHECK", conf, pod.path) == (0, None)
    # A DEL never fails for want of an agent, whatever agentDown says: the Python plugin removes
    # the in-pod rules, as its own DEL does without an agent.
    assert run_plugin(exe, "DEL", netconf(sock), pod.path) == (0, None)
    assert not installed(pod, "iptables") and not captured(pod, "iptables")
    rc, out = run_plugin(exe, "ADD", netconf(sock, agentDown="sometimes"), pod.path)
    assert rc == 1 and out is not None and out["code"] == 4 and "agentDown" in out["msg"], out
    # Without the Python plugin beside it: inProcess can't help (try again); a DEL still succeeds.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy2(exe, alone / "redirect-cni")
    rc, out = run_plugin(str(alone / "redirect-cni"), "ADD", conf, pod.path)
    assert rc == 1 and out is not None and out["code"] == 11 and "redirect-cni-python" in out["details"], out
    assert not installed(pod, "iptables")
    assert run_plugin(str(alone / "redirect-cni"), "DEL", netconf(sock), pod.path) == (0, None)


def test_agent_socket_null_is_the_default_and_a_socket_path_is_bounded(bin_dir: str, tmp_path: Path) -> None:
    """``"agentSocket": null``, which the Python plugin and ``install`` take for "none given", is
    the default socket to the thin plugin, as a left-out one (it used to refuse every command,
    DEL included, with 4); a path longer than a unix socket's is refused by both plugins and by
    ``install`` alike."""
    exe = os.path.join(bin_dir, "redirect-cni")
    for command, netns in (("DEL", "/run/netns/rdrt-does-not-exist"), ("STATUS", ""), ("GC", "")):
        conf: dict[str, Any] = {"cniVersion": "1.1.0", "name": "n", "type": "redirect-cni"}
        left_out = run_plugin(exe, command, conf, netns)
        assert run_plugin(exe, command, {**conf, "agentSocket": None}, netns) == left_out, command
    assert run_plugin(exe, "DEL", {"cniVersion": "1.1.0", "agentSocket": None}, "/run/netns/rdrt-none") == (0, None)
    assert inst.plugin_entry({"agentSocket": None})["agentSocket"] is None
    for path in ("/" + "s" * 107, "/run/" + "\u00e9" * 52, ""):
        for p in (exe, PYTHON_PLUGIN):
            rc, out = run_plugin(p, "DEL", {"cniVersion": "1.1.0", "agentSocket": path}, "/run/netns/rdrt-none")
            assert rc == 1 and out is not None and out["code"] == 4 and "agentSocket" in out["msg"], (p, out)
        with pytest.raises(inst.InstallError, match="agentSocket"):
            inst.plugin_entry({"agentSocket": path})
    ok = str(tmp_path / "a.sock")  # 107 bytes: still a socket path
    ok = ok + "/" + "s" * (107 - len(ok) - 1)
    assert len(ok) == 107 and inst.plugin_entry({"agentSocket": ok})["agentSocket"] == ok
    assert run_plugin(exe, "DEL", {"cniVersion": "1.1.0", "agentSocket": ok}, "/run/netns/rdrt-none") == (0, None)


def _both(bin_dir: str, command: str, conf: dict[str, Any], env: dict[str, bytes], cwd: str | None = None) -> list[
        tuple[int, dict[str, Any] | None]]:
    """The thin plugin's answer and the Python plugin's, run with ``env`` (bytes: any value) in ``cwd``."""
    answers = []
    for exe in (os.path.join(bin_dir, "redirect-cni"), PYTHON_PLUGIN):
        e = {b"PATH": os.environ["PATH"].encode(), b"CNI_COMMAND": command.encode(), b"CNI_CONTAINERID": b"c1",
             b"CNI_IFNAME": b"eth0", b"CNI_PATH": b"/usr/lib/cni", b"CNI_ARGS": b"", **env}
        p = subprocess.run([exe], input=json.dumps(conf).encode(), env=e, capture_output=True, timeout=60, cwd=cwd)
        assert b"Traceback" not in p.stderr, p.stderr.decode()[-2000:]
        answers.append((p.returncode, json.loads(p.stdout) if p.stdout.strip() else None))
    return answers


@pytest.mark.parametrize("name,value,words", [
    ("CNI_NETNS", b"/run/netns/\xff", "CNI_NETNS is not UTF-8"),
    ("CNI_ARGS", b"K8S_POD_NAME=\xc3(", "CNI_ARGS is not UTF-8"),
    ("CNI_ARGS", b"A=" + b"x" * 40_000, "CNI_ARGS is longer than 32768 bytes"),
    ("CNI_CONTAINERID", b"c" * 32_768 + b"c", "CNI_CONTAINERID is longer than 32768 bytes"),
    ("CNI_PATH", b"\x01" * 9_000, "the CNI_* variables are longer than 49152 bytes in all (as JSON)"),
    ("CNI_NETNS", b"nsdir/p1", "CNI_NETNS is a relative path"),
])
def test_a_bad_cni_variable_gets_the_same_answer_from_both_plugins(bin_dir: str, pod: Pod, tmp_path: Path,
                                                                    name: str, value: bytes, words: str) -> None:
    """Checked before anything else of the request, in both plugins: ADD and CHECK fail with 7
    naming the variable, nothing installed; a DEL succeeds having done nothing (no ADD took the
    value, so nothing of ours is there). A relative CNI_NETNS path is refused even when it names
    the pod's netns from the plugin's working directory: the thin plugin's agent has another."""
    (tmp_path / "nsdir").mkdir()
    (tmp_path / "nsdir" / "p1").symlink_to(pod.path)
    conf = {"cniVersion": "1.0.0", "name": "n", "type": "redirect-cni", "agentSocket": str(tmp_path / "none.sock"),
            "agentDown": "inProcess"}
    env = {b"CNI_NETNS": pod.path.encode(), name.encode(): value}
    for command in ("ADD", "CHECK"):
        thin, py = _both(bin_dir, command, conf, env, cwd=str(tmp_path))
        assert thin == py, (command, thin, py)
        assert thin[0] == 1 and thin[1] is not None and thin[1]["code"] == 7 and words in thin[1]["msg"], thin
        assert not installed(pod, "iptables")
    assert _both(bin_dir, "DEL", conf, env, cwd=str(tmp_path)) == [(0, None)] * 2
    if name != "CNI_NETNS":  # STATUS and GC take no CNI_NETNS, but the other variables are checked alike
        thin, py = _both(bin_dir, "STATUS", {**conf, "cniVersion": "1.1.0"}, env)
        assert thin == py and thin[0] == 1 and thin[1] is not None and thin[1]["code"] == 7, (thin, py)


#: Configs that fail whatever an agent would say, most with two problems: (command, the config's
#: members, the code both plugins answer, whether the thin plugin alone (no redirect-cni-python
#: beside it) answers word for word too, or only the same code). NONE: a socket nobody listens at.
NONE = "/run/rdrt-no-agent-here.sock"
CONFIG_ERRORS: dict[str, tuple[str, dict[str, Any], int, bool]] = {
    "version-and-socket": ("ADD", {"cniVersion": "9.9.9", "agentSocket": ""}, 1, True),
    "version-and-down": ("ADD", {"cniVersion": "9.9.9", "agentSocket": NONE, "agentDown": "sometimes"}, 1, True),
    "no-version-and-socket": ("DEL", {"agentSocket": "/" + "s" * 200}, 4, True),
    "number-version-and-down": ("CHECK", {"cniVersion": 5, "agentDown": None}, 4, True),
    "null-version": ("STATUS", {"cniVersion": None, "agentSocket": NONE}, 4, True),
    "version-no-agent": ("ADD", {"cniVersion": "0.2.0", "agentSocket": NONE}, 1, True),
    "version-no-agent-status": ("STATUS", {"cniVersion": "2.0.0", "agentSocket": NONE}, 1, True),
    "check-too-old-no-agent": ("CHECK", {"cniVersion": "0.3.1", "agentSocket": NONE}, 1, True),
    "mode-and-socket": ("ADD", {"cniVersion": "1.0.0", "mode": "both", "agentSocket": ""}, 4, False),
    "timeout-and-down": ("ADD", {"cniVersion": "1.0.0", "agentSocket": NONE, "agentTimeout": 0,
                                 "agentDown": "x"}, 4, False),
}


@pytest.mark.parametrize("kind", sorted(CONFIG_ERRORS))
def test_a_bad_config_gets_the_same_answer_from_both_plugins_cni_version_first(
        bin_dir: str, pod: Pod, tmp_path: Path, kind: str) -> None:
    """A config that fails whatever an agent would say: both plugins answer alike, word for word,
    checking cniVersion first as the CNI spec has it (1 for an unsupported version, even when
    agentSocket or agentDown is bad too, or no agent listens), and nothing is installed. The thin
    plugin without redirect-cni-python beside it answers the same code itself."""
    command, members, code, word_for_word = CONFIG_ERRORS[kind]
    conf = {"name": "n", "type": "redirect-cni", **members}
    thin, py = _both(bin_dir, command, conf, {b"CNI_NETNS": pod.path.encode()})
    assert thin == py, (thin, py)
    assert thin[0] == 1 and thin[1] is not None and thin[1]["code"] == code, thin
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy2(os.path.join(bin_dir, "redirect-cni"), alone / "redirect-cni")
    rc, out = run_plugin(str(alone / "redirect-cni"), command, conf, pod.path)
    assert rc == 1 and out is not None and out["code"] == code, out
    assert out == thin[1] if word_for_word else out["msg"].split("=")[0] in ("agentSocket", "agentDown"), out
    assert not installed(pod, "iptables")


@contextlib.contextmanager
def agent_that_goes_away(path: str) -> Iterator[list[str]]:
    """A socket at ``path`` that takes each request and closes the connection without answering,
    as an agent killed mid-request does: yields the types of the requests taken so far."""
    import socket

    taken: list[str] = []
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return  # shut down: the test is over
            with conn:
                conn.settimeout(20)
                with contextlib.suppress(OSError):
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
                    for fd in fds:
                        os.close(fd)
                    taken.append(json.loads(msg)["type"])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield taken
    finally:
        srv.shutdown(socket.SHUT_RDWR)
        srv.close()
        t.join(10)
        assert not t.is_alive()


def test_an_agent_gone_mid_request_is_try_again_from_both_plugins(bin_dir: str, pod: Pod, tmp_path: Path) -> None:
    """The agent takes the request and closes without answering (killed, restarting): ADD and
    CHECK fail with 11, "try again later", from both plugins (an answer that never came is no
    refusal: 103 is the agent's refusal); a DEL succeeds from both, having removed what the
    netns held of ours as when no agent listens. Nothing is installed."""
    path = str(tmp_path / "gone.sock")
    conf = netconf(path, mode="ambient")
    args = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_UID=uid-gone"
    with agent_that_goes_away(path) as taken:
        for exe in (os.path.join(bin_dir, "redirect-cni"), PYTHON_PLUGIN):
            for command in ("ADD", "CHECK"):
                rc, out = run_plugin(exe, command, conf, pod.path, args=args)
                assert rc == 1 and out is not None and out["code"] == 11, (exe, command, out)
                assert "went away without answering" in out["msg"], (exe, command, out)
                assert not installed(pod, "iptables")
            redirect.setup(pod.name, redirect.RedirectConfig(mode="ambient"))  # what a half-done ADD left
            assert installed(pod, "iptables")
            assert run_plugin(exe, "DEL", conf, pod.path, args=args) == (0, None), exe
            assert not installed(pod, "iptables")
        assert set(taken) <= {"cni", "add", "check", "del"} and {"cni", "add", "check", "del"} <= set(taken), taken


# --- odd and hostile peers at agentSocket (the peer is what is under test here) -----------------


def _plugin_bounded(exe: str, conf: dict[str, Any], netns: str, command: str = "ADD", limit: int = 8 << 20,
                    seconds: float = 30) -> tuple[int | None, bytes]:
    """Run the plugin, reading at most ``limit`` bytes of its stdout and waiting at most ``seconds``
    (then it is killed: None as its code), whatever it does."""
    env = {"PATH": os.environ.get("PATH", ""), "CNI_COMMAND": command, "CNI_CONTAINERID": "c1", "CNI_NETNS": netns,
           "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni", "CNI_ARGS": ""}
    p = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(json.dumps(conf).encode())
    p.stdin.close()
    got = bytearray()
    timer = threading.Timer(seconds, p.kill)
    timer.start()
    try:
        while len(got) <= limit:
            chunk = p.stdout.read1(1 << 16)
            if not chunk:
                break
            got += chunk
    finally:
        p.kill()  # (no-op once it exited)
        rc = p.wait()
        timer.cancel()
    return (None if rc == -signal.SIGKILL else rc), bytes(got)


def test_the_tiniest_agent_timeout_is_still_a_timeout(bin_dir: str, tmp_path: Path) -> None:
    """agentTimeout 1e-9 against an agent socket whose backlog is full: not SO_SNDTIMEO {0,0} (no
    timeout: connect would wait forever) but a timeout rounded up: code 11 at once."""
    import socket

    exe = os.path.join(bin_dir, "redirect-cni")
    path = str(tmp_path / "busy.sock")
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
        srv.bind(path)
        srv.listen(0)
        for _ in range(64):  # pending connections until one more would wait
            c = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                break
        else:
            pytest.fail("the listener's backlog never filled")
        rc, out = _plugin_bounded(exe, netconf(path, agentTimeout=1e-9), "/run/netns/rdrt-none", seconds=20)
        assert rc == 1, (rc, out)
        res = json.loads(out)
        assert res["code"] == 11 and "node agent" in res["msg"], res


@pytest.mark.parametrize("what", ["dev-zero", "huge-file"])
def test_the_agents_output_fd_is_bounded(bin_dir: str, tmp_path: Path, what: str) -> None:
    """An answer whose output fd is /dev/zero (endless) or a file over the bound: refused (100)
    at once, never copied; the ADD it said succeeded is undone (the Python plugin's DEL) first."""
    import socket

    exe = os.path.join(bin_dir, "redirect-cni")
    path = str(tmp_path / "odd-agent.sock")
    if what == "dev-zero":
        out_fd = os.open("/dev/zero", os.O_RDONLY)
    else:
        out_fd = os.open(tmp_path / "huge", os.O_RDWR | os.O_CREAT, 0o600)
        os.truncate(out_fd, 1 << 30)  # sparse: 1 GiB of zeros
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(4)
    srv.settimeout(20)

    def agent() -> None:
        with contextlib.suppress(OSError):
            conn, _ = srv.accept()
            with conn:
                _, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
                for fd in fds:
                    os.close(fd)
                socket.send_fds(conn, [b'{"v":1,"type":"result","ok":true,"rc":0}'], [out_fd])
                conn.settimeout(20)
                conn.recv(1)  # until the plugin is done

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    try:
        rc, out = _plugin_bounded(exe, netconf(path, agentTimeout=10), "/run/netns/rdrt-none", seconds=20)
        assert rc == 1 and len(out) < 4096, (rc, len(out), out[:200])
        res = json.loads(out)
        assert res["code"] == 100 and "output" in res["msg"], res
        # it said the ADD succeeded: what it may have installed is removed before the ADD fails
        assert "was removed" in res["msg"], res
    finally:
        srv.close()
        t.join(25)
        os.close(out_fd)


def test_a_stream_socket_at_agent_socket_is_no_agent(bin_dir: str, pod: Pod, tmp_path: Path) -> None:
    """agentSocket names a stream socket (connect: EPROTOTYPE): as when no agent listens, a DEL
    falls back to the Python plugin (which removes the pod's capture), an ADD tries again or, with
    agentDown inProcess, is done by the Python plugin."""
    import socket

    exe = os.path.join(bin_dir, "redirect-cni")
    path = str(tmp_path / "stream.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen(4)
        rc, out = run_plugin(exe, "ADD", netconf(path), pod.path)
        assert rc == 1 and out is not None and out["code"] == 11 and "not running" in out["msg"], out
        assert run_plugin(exe, "ADD", netconf(path, agentDown="inProcess"), pod.path) == (0, PREV)
        assert installed(pod, "iptables")
        assert run_plugin(exe, "DEL", netconf(path), pod.path) == (0, None)
        assert not installed(pod, "iptables")


# --- with the agent --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["iptables", "nftables", "ebpf"])
def test_sidecar_add_check_del_status_gc_through_the_agent(bin_dir: str, make_pod: Callable[..., Pod],
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            backend: str) -> None:
    with agent_node(tmp_path, backend, monkeypatch) as n:
        agent = n.start_agent()
        thin = Thin(bin_dir, n)
        pod = make_pod()
        capture = {"inbound_ports": []} if backend == "ebpf" else {}
        if backend == "ebpf":  # the agent loads the host programs at start, not on the first pod
            wait_log(agent.log, lambda e: e.get("msg") == "eBPF host programs ready", 60, agent.proc)
        log_file = tmp_path / "cni.log"
        conf = netconf(n.events, backend=backend, capture=capture, logFile=str(log_file), logJson=True)
        assert not captured(pod, backend)
        rc, out = thin("ADD", conf, pod.path)
        assert (rc, out) == (0, PREV)  # prevResult passed through
        assert captured(pod, backend)
        assert thin("ADD", conf, pod.path) == (0, PREV)  # a repeated ADD is harmless
        assert thin("CHECK", conf, pod.path) == (0, None)
        old = netconf(n.events, "0.4.0", backend=backend, capture=capture)
        rc, out = thin("ADD", old, pod.path)
        assert rc == 0 and out is not None and out["cniVersion"] == "0.4.0" and out["ips"][0]["version"] == "4"
        assert thin("STATUS", netconf(n.events, "1.1.0", backend=backend)) == (0, None)
        assert thin("GC", netconf(n.events, "1.1.0", backend=backend)) == (0, None)
        assert thin("DEL", conf, pod.path) == (0, None)
        assert not installed(pod, backend)
        assert not captured(pod, backend)
        assert thin("DEL", conf, pod.path) == (0, None)  # idempotent
        assert thin("DEL", conf, "/run/netns/rdrt-does-not-exist") == (0, None)
        # the config's logFile has the plugin's lines, as the Python plugin writes them
        lines = [json.loads(ln) for ln in log_file.read_text().splitlines()]
        words = [ln["msg"].split()[0] for ln in lines]
        assert [w for w in words if w.isupper()] == ["ADD", "ADD", "CHECK", "DEL", "DEL", "DEL"], lines
        assert all(ln["container_id"] == "ctr1" and ln["logger"] == "redirect.cni" for ln in lines), lines
        assert n.agent is not None
        assert n.agent.metric('redirect_agent_events_total{type="cni_add"}') == 3


def test_kube_system_is_left_alone_unless_the_entry_says_otherwise(bin_dir: str, pod: Pod, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the thin plugin and the agent, an entry without ``excludeNamespaces`` leaves
    kube-system pods uncaptured (the Python plugin's default: the agent reads the entry as it
    does); ``[]`` captures them; the entry ``install`` writes says the same."""
    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        n.start_agent()
        thin = Thin(bin_dir, n)
        kube_system = "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns"
        written = inst.plugin_entry({"agentSocket": n.events})
        for entry in (netconf(n.events), netconf(n.events, **{k: v for k, v in written.items() if k != "type"})):
            assert thin("ADD", entry, pod.path, args=kube_system) == (0, PREV)
            assert not installed(pod, "iptables") and not captured(pod, "iptables")
        none = netconf(n.events, excludeNamespaces=[])
        assert thin("ADD", none, pod.path, args=kube_system) == (0, PREV)
        assert captured(pod, "iptables")
        assert thin("DEL", none, pod.path, args=kube_system) == (0, None)
        assert not installed(pod, "iptables")


def test_errors_are_the_python_plugins_word_for_word(bin_dir: str, pod: Pod, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What the agent answers for a bad request is what the Python plugin prints for it."""
    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        n.start_agent()
        thin = Thin(bin_dir, n)
        enc = encode_annotations({T + "excludeOutboundPorts": "22,ssh"})
        cases: list[tuple[str, dict[str, Any] | bytes, str, str]] = [
            ("ADD", netconf(n.events, capture={"proxy_port": 0}), pod.path, ""),
            ("ADD", netconf(n.events, mode="both"), pod.path, ""),
            ("ADD", netconf(n.events, backend="nope"), pod.path, ""),
            ("ADD", {"cniVersion": "0.2.0", "agentSocket": n.events}, pod.path, ""),
            ("ADD", {"cniVersion": 5, "agentSocket": n.events}, pod.path, ""),
            ("ADD", netconf(n.events), pod.path, f"K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;"
                                                 f"REDIRECT_ANNOTATIONS={enc}"),
            ("ADD", netconf(n.events), pod.path, "garbage"),
            ("ADD", netconf(n.events), "", ""),
            ("ADD", netconf(n.events), "/run/netns/rdrt-does-not-exist", ""),
            ("ADD", netconf(n.events, prev=None, prevResult=[1]), pod.path, ""),
            ("CHECK", netconf(n.events, "0.3.1"), pod.path, ""),
            ("CHECK", netconf(n.events), pod.path, ""),
        ]
        for command, conf, netns, args in cases:
            got = thin(command, conf, netns, args=args)
            want = run_plugin(PYTHON_PLUGIN, command, conf, netns, args=args)
            assert got == want, (command, conf, got, want)
            assert got[0] == 1
            assert not installed(pod, "iptables")


def test_a_malformed_cni_message_is_refused_and_the_agent_serves_on(bin_dir: str, pod: Pod, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The envelope of a ``cni`` message is checked before anything runs: a missing, extra or
    non-file fd, a length that does not match, a variable that is not a CNI one: ``bad_request``."""
    import socket

    from redirect.ambient.agent import protocol

    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        n.start_agent()

        def ask(msg: dict[str, Any], fds: tuple[int, ...]) -> dict[str, Any]:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.settimeout(10)
                s.connect(n.events)
                protocol.send(s, msg, fds)
                got = protocol.recv(s, max_fds=1)
            assert got is not None
            for fd in got[1]:
                os.close(fd)
            return got[0]

        memfd = os.memfd_create("rdrt-test")
        os.write(memfd, b"{}")
        r, w = os.pipe()
        try:
            env = {"CNI_COMMAND": "ADD", "CNI_NETNS": pod.path, "CNI_CONTAINERID": "c", "CNI_IFNAME": "eth0"}
            cases: list[tuple[Any, tuple[int, ...]]] = [
                ({"env": env, "stdin_len": 2}, ()),                    # no stdin fd
                ({"env": env, "stdin_len": 2}, (memfd, memfd)),        # two fds
                ({"env": env, "stdin_len": 2}, (r,)),                  # a pipe, not a memfd
                ({"env": env, "stdin_len": 3}, (memfd,)),              # length does not match
                ({"env": env, "stdin_len": MAX_STDIN + 1}, (memfd,)),  # too long
                ({"env": {**env, "LD_PRELOAD": "x"}, "stdin_len": 2}, (memfd,)),
                ({"env": {**env, "CNI_ARGS": 5}, "stdin_len": 2}, (memfd,)),
                ({"env": env}, (memfd,)),
                ("ADD", (memfd,)),
            ]
            for body, fds in cases:
                reply = ask({"type": "cni", "cni": body}, fds)
                assert reply["ok"] is False and reply["reason"] == "bad_request", (body, reply)
        finally:
            for fd in (memfd, r, w):
                os.close(fd)
        assert not installed(pod, "iptables")
        thin = Thin(bin_dir, n)
        assert thin("ADD", netconf(n.events), pod.path) == (0, PREV)
        assert installed(pod, "iptables")
        assert thin("DEL", netconf(n.events), pod.path) == (0, None)


def test_hundred_concurrent_adds(bin_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node starting 100 pods at once: every ADD succeeds and installs capture; DELs leave nothing."""
    count = 100
    names = [f"rdrt-thin{i}-{os.urandom(2).hex()}" for i in range(count)]
    with agent_node(tmp_path, "nftables", monkeypatch) as n:
        try:
            for name in names:
                netkit.create_netns(name)
            agent = n.start_agent()
            thin = Thin(bin_dir, n)
            fds_before = len(os.listdir(f"/proc/{agent.proc.pid}/fd"))
            conf = netconf(n.events, backend="nftables")

            def add(name: str) -> tuple[int, dict[str, Any] | None, float]:
                t0 = time.perf_counter()
                rc, out = thin("ADD", conf, f"/run/netns/{name}", container=name)
                return rc, out, (time.perf_counter() - t0) * 1e3

            with concurrent.futures.ThreadPoolExecutor(count) as ex:
                results = list(ex.map(add, names))
            errors = [(name, out) for name, (rc, out, _) in zip(names, results, strict=True) if rc != 0]
            assert not errors, errors[:3]
            ms = sorted(r[2] for r in results)
            print(f"100 concurrent ADDs through the thin plugin: p50 {ms[49]:.0f} ms, p99 {ms[98]:.0f} ms")
            cfg = redirect.RedirectConfig()
            assert all(redirect.check(name, cfg, backend="nftables").ok for name in names)
            with concurrent.futures.ThreadPoolExecutor(16) as ex:
                dels = list(ex.map(lambda name: thin("DEL", conf, f"/run/netns/{name}", container=name), names))
            assert all(d == (0, None) for d in dels), [d for d in dels if d != (0, None)][:3]
            assert not any(redirect.show(name, backend="nftables")["installed"] for name in names)
            # 200 requests, each with a memfd in and one out: none kept (a worker thread opens the
            # netns lock file once and keeps a pidfd of its own for the native netns calls, so at
            # most twice --workers more). Some go a moment after the answer
            # (a client's connection once its EOF is read, a libnftables context freed off the
            # request's path): polled for, bounded.
            def fds() -> list[str]:
                out = []
                for f in os.listdir(f"/proc/{agent.proc.pid}/fd"):
                    with contextlib.suppress(OSError):  # (closed meanwhile)
                        out.append(os.readlink(f"/proc/{agent.proc.pid}/fd/{f}"))
                return out

            deadline = time.monotonic() + 30
            while len(fds()) > fds_before + 2 * 16 + 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(fds()) <= fds_before + 2 * 16 + 4, sorted(fds())
        finally:
            for name in names:
                netkit.remove_netns(name)


def test_a_slow_pod_does_not_delay_the_others(bin_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One pod's ADD waits (its netns lock is held, as by a concurrent setup of that netns); the ADDs
    of other pods are served meanwhile, and the slow one completes once the lock is free."""
    from redirect import api
    from redirect.kernel import netns as rn

    names = [f"rdrt-ths{i}-{os.urandom(2).hex()}" for i in range(13)]
    with agent_node(tmp_path, "nftables", monkeypatch) as n:
        try:
            for name in names:
                netkit.create_netns(name)
            n.start_agent("--workers", "4")
            thin = Thin(bin_dir, n)
            conf = netconf(n.events, backend="nftables")
            slow, others = names[0], names[1:]
            with concurrent.futures.ThreadPoolExecutor(8) as ex:
                with api.netns_lock(rn.netns_inode(slow)):
                    pending = ex.submit(thin, "ADD", conf, f"/run/netns/{slow}", container=slow)
                    time.sleep(0.5)  # the slow ADD is in the agent, waiting for the lock
                    t0 = time.monotonic()
                    done = list(ex.map(lambda m: thin("ADD", conf, f"/run/netns/{m}", container=m), others))
                    others_s = time.monotonic() - t0
                    assert all(d == (0, PREV) for d in done), done[:3]
                    assert not pending.done()
                assert pending.result(timeout=20) == (0, PREV)
            assert others_s < 8, others_s
            cfg = redirect.RedirectConfig()
            assert all(redirect.check(name, cfg, backend="nftables").ok for name in names)
            for name in names:
                assert thin("DEL", conf, f"/run/netns/{name}", container=name) == (0, None)
        finally:
            for name in names:
                netkit.remove_netns(name)


def test_agent_restart_during_adds_fails_them_with_try_again(bin_dir: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL of the agent while ADDs are in flight: each ADD either succeeded with capture in place,
    or failed with code 11; none succeeded without capture. Four of them are surely in the agent at
    the kill (their netns locks are held here). After the restart the retries succeed."""
    from redirect import api
    from redirect.kernel import netns as rn

    count = 40
    names = [f"rdrt-thr{i}-{os.urandom(2).hex()}" for i in range(count)]
    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        try:
            for name in names:
                netkit.create_netns(name)
            agent = n.start_agent("--workers", "6")
            thin = Thin(bin_dir, n)
            conf = netconf(n.events, agentTimeout=20)
            started = threading.Event()

            def add(name: str) -> tuple[int, dict[str, Any] | None]:
                started.set()
                return thin("ADD", conf, f"/run/netns/{name}", container=name)

            held = names[:4]
            with concurrent.futures.ThreadPoolExecutor(count) as ex, contextlib.ExitStack() as locks:
                for name in held:
                    locks.enter_context(api.netns_lock(rn.netns_inode(name)))
                futs = [ex.submit(add, name) for name in names]
                started.wait(10)
                wait_log(agent.log, lambda e: "ADD container=" in str(e.get("msg", "")), 20, agent.proc)
                agent.proc.send_signal(signal.SIGKILL)
                agent.proc.wait(5)
                locks.close()
                results = [f.result() for f in futs]
            cfg = redirect.RedirectConfig()
            ok = [name for name, (rc, _) in zip(names, results, strict=True) if rc == 0]
            failed = [(name, out) for name, (rc, out) in zip(names, results, strict=True) if rc != 0]
            assert failed, "the kill came after every ADD was served: nothing tested"
            assert all(out is not None and out["code"] == 11 for _, out in failed), failed[:3]
            for name in held:  # in the agent at the kill: it went away without answering
                rc, out = results[names.index(name)]
                assert rc == 1 and out is not None and "went away without answering" in out["msg"], out
            assert all(redirect.check(name, cfg, backend="iptables").ok for name in ok)
            print(f"agent SIGKILL during {count} ADDs: {len(ok)} done, {len(failed)} 'try again'")
            n.start_agent()
            for name, _ in failed:  # the runtime retries
                assert thin("ADD", conf, f"/run/netns/{name}", container=name) == (0, PREV)
                assert redirect.check(name, cfg, backend="iptables").ok
            for name in names:
                assert thin("DEL", conf, f"/run/netns/{name}", container=name) == (0, None)
        finally:
            for name in names:
                netkit.remove_netns(name)


def test_ambient_pod_through_the_thin_plugin(bin_dir: str, make_pod: Callable[..., Pod], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Ambient mode: the agent enrols the pod itself (rules, node sets, the node proxy's ack)."""
    from redirect.ambient import node as rnode
    from redirect.ambient.agent import client
    from tests.test_agent import record_of

    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        n.start_agent()
        thin = Thin(bin_dir, n)
        pod = make_pod()
        prev = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": pod.path}],
                "ips": [{"address": f"{pod.pod_ip4}/24", "interface": 0}]}
        conf = netconf(n.events, prev=prev, mode="ambient")
        args = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_UID=uid-thin-1"
        rc, out = thin("ADD", conf, pod.path, args=args)
        assert rc == 1 and out is not None and out["code"] == 103 and "no node proxy" in out["msg"], out
        assert record_of(pod.name) is None and not installed(pod, "iptables")
        n.start_proxy()
        rc, out = thin("ADD", conf, pod.path, args=args)
        assert rc == 0 and out == convert_result(prev, "1.0.0"), out
        (enrolled,) = client.list_pods(n.events)
        assert enrolled["uid"] == "uid-thin-1" and rnode.list_pods(n.ns) == {pod.pod_ip4: "uid-thin-1"}
        assert [e["pod"] for e in n.proxy_events("pod_added")] == ["uid-thin-1"]
        assert thin("CHECK", conf, pod.path, args=args) == (0, None)
        assert thin("DEL", conf, pod.path, args=args) == (0, None)
        assert client.list_pods(n.events) == [] and rnode.list_pods(n.ns) == {}
        assert record_of(pod.name) is None and not installed(pod, "iptables")


def test_an_add_cut_by_an_agent_kill_leaves_nothing_of_ours_in_the_pod_netns(
        bin_dir: str, make_pod: Callable[..., Pod], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL of the agent while it waits for the node proxy's ack of an ambient ADD: the ADD fails
    (11), and before the plugin answered, what the pod's netns held of ours (rules, routes, the
    pod's record) was removed, with the agent still down (the DEL without an agent). The node-set
    entry and the node proxy's listeners are the agent's: its restart removes them."""
    from redirect.ambient import node as rnode
    from tests.test_agent import pod_leftovers

    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        agent = n.start_agent(env={"REDIRECT_AGENT_FAULT": "add.proxy_sent"})
        n.start_proxy()
        thin = Thin(bin_dir, n)
        pod = make_pod()
        uid = "uid-cut-1"
        prev = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": pod.path}],
                "ips": [{"address": f"{pod.pod_ip4}/24", "interface": 0}]}
        conf = netconf(n.events, prev=prev, mode="ambient")
        rc, out = thin("ADD", conf, pod.path, args=f"K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_UID={uid}")
        assert agent.proc.wait(5) == -signal.SIGKILL, agent.log.read_text()[-2000:]
        assert rc == 1 and out is not None and out["code"] == 11, out
        left = [x for x in pod_leftovers(pod, uid, n, ask_agent=False) if not x.startswith(("node set", "listener"))]
        assert not left, left
        assert "went away" in out["msg"] and "was removed" in out["msg"], out
        assert rnode.list_pods(n.ns) == {pod.pod_ip4: uid}  # the agent's, while it is down
        n.start_agent()
        n.wait_synced(2)
        assert not pod_leftovers(pod, uid, n)


# --- a real runtime: containerd + ctr run --cni through the thin plugin --------------------------

@needs_containerd
@pytest.mark.parametrize("mode,backend", [("sidecar", "iptables"), ("sidecar", "nftables"), ("sidecar", "ebpf"),
                                          ("ambient", "iptables"), ("ambient", "nftables"), ("ambient", "ebpf")])
def test_containerd_pod_through_the_thin_plugin(containerd: Containerd, tmp_path: Path,  # noqa: F811
                                                monkeypatch: pytest.MonkeyPatch, mode: str, backend: str) -> None:
    """``ctr run --cni`` with bridge + host-local + the thin redirect-cni: the container's traffic is
    captured (sidecar: on its proxy port; ambient: by the node proxy), and the runtime's DEL (empty
    CNI_NETNS) leaves nothing of it behind."""
    from redirect.ambient import node as rnode
    from redirect.ambient.agent import client

    with agent_node(tmp_path, backend, monkeypatch) as n:
        agent = n.start_agent()
        if backend == "ebpf":  # else its first pod waits for the host programs' compile (bounded by agentTimeout)
            wait_log(agent.log, lambda e: e.get("msg") == "eBPF host programs ready", 300, agent.proc)
        if mode == "ambient":
            n.start_proxy()
        with bridge_net(containerd.base, "rdrt-thin", 246) as net:
            entry: dict[str, Any] = {"mode": mode, "backend": backend, "agentSocket": n.events}
            if backend == "ebpf":
                entry["capture"] = {"inbound_ports": []}
            inst.install(net.net_d, net.bin_d, entry)
            assert open(os.path.join(net.bin_d, "redirect-cni"), "rb").read() == open(inst.THIN_BINARY, "rb").read()
            cid = f"rdrt-{os.urandom(3).hex()}"
            try:
                t0 = time.monotonic()
                with ctr_run(containerd, net, cid) as run:
                    pid = wait_task(containerd, cid, run)
                    started = time.monotonic() - t0
                    probe = f"echo from-container | /bin/busybox nc -w 2 {net.target} 8080"
                    if mode == "sidecar":
                        with TcpListener(f"/proc/{pid}/ns/net", 15001, label="proxy") as proxy:
                            containerd.ctr("task", "exec", "--exec-id", "probe", cid, "/bin/busybox", "sh", "-c", probe,
                                           timeout=15)
                            conns = proxy.wait_for(1, timeout=5)
                        assert conns[0].line == "from-container" and conns[0].orig_dst == (net.target, 8080)
                    else:
                        (pod,) = client.list_pods(n.events)  # enrolled before the task ran
                        assert pod["netns_inode"] == os.stat(f"/proc/{pid}/ns/net").st_ino
                        containerd.ctr("task", "exec", "--exec-id", "probe", cid, "/bin/busybox", "sh", "-c", probe,
                                       timeout=15)
                        e = wait_log(n.proxy_log, lambda e: e["event"] == "accept" and e["pod"] == pod["uid"])
                        assert e["orig_dst"] == [net.target, 8080], e
                    containerd.ctr("task", "kill", "-s", "KILL", cid)
                    run.wait(20)
                    wait_log(agent.log, lambda e: str(e.get("msg", "")).startswith(f"DEL container=default-{cid}"), 10)
                    msgs = [str(e.get("msg", "")) for e in read_log(agent.log)]
                    assert any(m.startswith(f"ADD container=default-{cid}") for m in msgs), msgs[-5:]
                    if mode == "ambient":
                        assert client.list_pods(n.events) == [] and rnode.list_pods(n.ns) == {}
                    if backend == "ebpf":  # the pod's host map entries: gone once the kernel let go of its netns
                        from redirect.backends import ebpf

                        gc_conf = {"cniVersion": "1.1.0", "name": "rdrt-thin", "type": "redirect-cni",
                                   "backend": "ebpf", "agentSocket": n.events}
                        deadline = time.monotonic() + 20
                        while ebpf.registered_pods() and time.monotonic() < deadline:
                            assert run_plugin(os.path.join(net.bin_d, "redirect-cni"), "GC", gc_conf) == (0, None)
                            time.sleep(0.2)
                        assert ebpf.registered_pods() == []
                    print(f"ctr run --cni ({mode}, {backend}) to a running captured container: {started * 1e3:.0f} ms")
            finally:
                inst.uninstall(net.net_d, net.bin_d)
            assert not os.path.exists(os.path.join(net.bin_d, "redirect-cni"))


def test_a_result_of_any_size_the_config_allows_is_printed_or_nothing_is_installed(
        bin_dir: str, pod: Pod, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prevResult near the 1 MiB stdin bound, of characters JSON could escape six times over: the
    agent's answer is the result as it came (UTF-8, not \\u escapes), which fits the thin plugin's
    bound, so the ADD succeeds with the Python plugin's very output; a result that would not fit
    fails the ADD in both plugins before anything is installed."""
    emoji = {**PREV, "dns": {"domain": "\U0001f600" * 250_000}}
    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        n.start_agent()
        thin = Thin(bin_dir, n)
        conf = json.dumps(netconf(n.events, prev=emoji), ensure_ascii=False).encode()
        assert len(conf) < MAX_STDIN
        env = {"PATH": os.environ["PATH"], "CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": pod.path,
               "CNI_IFNAME": "eth0", "CNI_ARGS": ""}
        p = subprocess.run([thin.exe], input=conf, env=env, capture_output=True, timeout=60)
        assert p.returncode == 0, p.stdout[:500]
        assert json.loads(p.stdout) == emoji and len(p.stdout) < MAX_STDIN
        assert installed(pod, "iptables")
        py = subprocess.run([PYTHON_PLUGIN], input=conf, env=env, capture_output=True, timeout=60)
        assert (py.returncode, py.stdout) == (0, p.stdout)
        assert thin("DEL", conf, pod.path) == (0, None)
        assert not installed(pod, "iptables")
        # 1e15 prints as 1000000000000000.0: a list of them grows 3.8 times, past the bound
        big = {**PREV, "dns": {"options": [1e15] * 200_000}}
        data = json.dumps(netconf(n.events, prev=None, prevResult=big), separators=(",", ":")).replace(
            "1000000000000000.0", "1e15")
        assert len(data) < MAX_STDIN
        for exe in (thin.exe, PYTHON_PLUGIN):
            rc, out = run_plugin(exe, "ADD", data.encode(), pod.path)
            assert rc == 1 and out is not None and out["code"] == 4 and "prevResult" in out["msg"], out
            assert not installed(pod, "iptables")
