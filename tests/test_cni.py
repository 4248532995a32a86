"""redirect-cni: annotations, the installer, and the plugin driven the way a runtime drives it.

The plugin tests exec the real console script with CNI env vars and a config on
stdin against a pod netns from the kit, then send real traffic.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from redirect.cni import install as inst
from redirect.cni.netconf import convert_result, encode_annotations, parse_cni_args, pod_annotations
from redirect.config import RedirectConfig
from redirect.errors import ConfigError
from redirect.istio.annotations import config_from_annotations, wants_capture
from tests.netkit import Pod, TcpListener, landing

PLUGIN = os.path.join(os.path.dirname(sys.executable), "redirect-cni")
T = "traffic.sidecar.istio.io/"

# --- annotations ---------------------------------------------------------------------------


def test_annotations_map_onto_config_fields() -> None:
    cfg = config_from_annotations({
        T + "includeOutboundIPRanges": "10.0.0.0/8, 192.168.0.0/16",
        T + "excludeOutboundIPRanges": "10.96.0.1/32",
        T + "includeInboundPorts": "8080,9090",
        T + "excludeInboundPorts": "22",
        T + "includeOutboundPorts": "5432",
        T + "excludeOutboundPorts": "3306",
        T + "excludeInterfaces": "eth1",
        "istio.io/reroute-virtual-interfaces": "tap0",
        "sidecar.istio.io/interceptionMode": "TPROXY",
        "sidecar.istio.io/proxyUID": "1500",
        "sidecar.istio.io/proxyGID": "1501",
        "unrelated.example.com/foo": "bar",
    })
    assert cfg.outbound_cidrs == ("10.0.0.0/8", "192.168.0.0/16")
    assert cfg.outbound_exclude_cidrs == ("10.96.0.1/32",)
    assert cfg.inbound_ports == (8080, 9090)
    assert cfg.inbound_exclude_ports == (22, 15020, 15021, 15090)  # Istio always adds the proxy's ports
    assert cfg.outbound_ports == (5432,)
    assert cfg.outbound_exclude_ports == (3306,)
    assert cfg.exclude_interfaces == ("eth1",)
    assert cfg.reroute_interfaces == ("tap0",)
    assert cfg.inbound_interception == "TPROXY"
    assert (cfg.proxy_uids, cfg.proxy_gids) == ((1500,), (1501,))


def test_annotations_star_kubevirt_alias_status_port_and_base() -> None:
    base = RedirectConfig(outbound_exclude_ports=(22,))
    cfg = config_from_annotations({
        T + "includeOutboundIPRanges": "*", T + "includeInboundPorts": "*",
        T + "kubevirtInterfaces": "net1", "status.sidecar.istio.io/port": "15999",
    }, base)
    assert cfg.outbound_cidrs == "*" and cfg.inbound_ports == "*"
    assert cfg.reroute_interfaces == ("net1",)
    assert 15999 in cfg.inbound_exclude_ports
    assert cfg.outbound_exclude_ports == (22,)  # the base survives
    assert config_from_annotations({}, base) is base


@pytest.mark.parametrize("ann,value", [
    (T + "includeOutboundIPRanges", "10.0.0.0/33"),
    (T + "excludeOutboundIPRanges", "*"),
    (T + "includeInboundPorts", "80,http"),
    (T + "excludeInboundPorts", "70000"),
    (T + "excludeOutboundPorts", "-1"),
    (T + "excludeInterfaces", "bad/name"),
    ("istio.io/reroute-virtual-interfaces", "lo"),
    ("sidecar.istio.io/interceptionMode", "MAGIC"),
    ("sidecar.istio.io/proxyUID", "nobody-such-user-xyz"),
    ("status.sidecar.istio.io/port", "1,2"),
])
def test_bad_annotation_names_annotation_and_value(ann: str, value: str) -> None:
    with pytest.raises(ConfigError) as ei:
        config_from_annotations({ann: value})
    assert ei.value.field == ann
    assert ei.value.value == value
    assert ann in str(ei.value)


def test_opt_outs() -> None:
    assert wants_capture({})
    assert not wants_capture({"sidecar.istio.io/inject": "false"})
    assert not wants_capture({"sidecar.istio.io/interceptionMode": "NONE"})
    assert wants_capture({"sidecar.istio.io/inject": "true"})


# --- plugin helpers (no kernel) -----------------------------------------------------------------


def test_cni_args_and_annotation_sources_merge_in_order() -> None:
    enc = encode_annotations({"a": "4"})
    assert "=" not in enc  # Go plugins split CNI_ARGS pairs on every "="
    args = parse_cni_args(f"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;REDIRECT_ANNOTATIONS={enc}")
    assert args["K8S_POD_NAMESPACE"] == "ns"
    conf = {"args": {"cni": {"annotations": {"a": "1", "b": "1", "c": "1"}}},
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"a": "2", "b": "2"}, "podAnnotations": {"a": "3"}}}
    assert pod_annotations(conf, args) == {"a": "4", "b": "2", "c": "1"}
    padded = base64.urlsafe_b64encode(json.dumps({"x": "y"}).encode()).decode()
    assert pod_annotations({}, {"REDIRECT_ANNOTATIONS": padded}) == {"x": "y"}


def test_prev_result_conversion() -> None:
    prev = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0"}], "ips": [{"address": "10.1.0.5/24"},
                                                                            {"address": "fd00::5/64"}]}
    old = convert_result(prev, "0.4.0")
    assert [ip["version"] for ip in old["ips"]] == ["4", "6"] and old["cniVersion"] == "0.4.0"
    back = convert_result(old, "1.0.0")
    assert back == prev
    assert convert_result(None, "1.0.0")["cniVersion"] == "1.0.0"


# --- installer ------------------------------------------------------------------------------------

CONFLISTS = {
    "indented": '{\n  "cniVersion": "1.0.0",\n  "name": "k8s",\n  "plugins": [\n    {\n      "type": "bridge",\n'
                '      "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.9.0.0/16"}]]}\n    },\n'
                '    {"type": "portmap", "capabilities": {"portMappings": true}}\n  ]\n}\n',
    "compact": '{"cniVersion":"0.4.0","name":"n","plugins":[{"type":"ptp","note":"a \\"]\\" in a string"}]}',
    "empty": '{"cniVersion": "1.0.0", "name": "e", "plugins": []}\n',
}


@pytest.mark.parametrize("kind", sorted(CONFLISTS))
def test_install_uninstall_round_trip_is_byte_identical(tmp_path: Any, kind: str) -> None:
    conf_dir, bin_dir = tmp_path / "net.d", tmp_path / "bin"
    conf_dir.mkdir()
    path = conf_dir / "10-net.conflist"
    original = CONFLISTS[kind].encode()
    path.write_bytes(original)
    os.chmod(path, 0o600)
    assert inst.install(str(conf_dir), str(bin_dir), {"backend": "iptables"}) == str(path)
    doc = json.loads(path.read_text())
    assert [p["type"] for p in doc["plugins"]][-1] == "redirect-cni"
    before = json.loads(original)["plugins"]
    assert doc["plugins"][: len(before)] == before  # every other plugin kept, in order
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert inst.install(str(conf_dir), str(bin_dir), {"backend": "iptables"}) is None  # no duplicate
    assert sum(p["type"] == "redirect-cni" for p in json.loads(path.read_text())["plugins"]) == 1
    thin, launcher = bin_dir / "redirect-cni", bin_dir / "redirect-cni-python"
    assert os.access(thin, os.X_OK) and thin.read_bytes() == open(inst.THIN_BINARY, "rb").read()
    assert os.access(launcher, os.X_OK) and launcher.read_text().startswith(f"#!{sys.executable}")
    assert inst.uninstall(str(conf_dir), str(bin_dir)) == [str(path)]
    assert path.read_bytes() == original
    assert not thin.exists() and not launcher.exists()
    assert sorted(os.listdir(conf_dir)) == ["10-net.conflist"]  # no temp files left


def test_install_replaces_an_outdated_entry(tmp_path: Any) -> None:
    (tmp_path / "10-a.conflist").write_text(CONFLISTS["indented"])
    inst.install(str(tmp_path), None, {"mode": "sidecar"})
    inst.install(str(tmp_path), None, {"excludeNamespaces": ["kube-system"]})
    mine = [p for p in json.loads((tmp_path / "10-a.conflist").read_text())["plugins"] if p["type"] == "redirect-cni"]
    assert len(mine) == 1 and mine[0]["excludeNamespaces"] == ["kube-system"]


def _documented_entry() -> dict[str, Any]:
    """The JSON block after "Our entry" in docs/cni-and-agent.md."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "cni-and-agent.md"), encoding="utf-8").read()
    after = text[text.index("Our entry, as `redirect-cni install` writes it"):]
    block = after[after.index("```json\n") + 8:]
    return dict(json.loads(block[: block.index("```")]))


def test_install_writes_the_entry_in_force_and_the_docs_show_it(tmp_path: Any) -> None:
    """``redirect-cni install`` writes every setting of our entry, each as the plugin reads it when
    left out (the thin plugin's agent socket aside: its default, which the Python plugin lacks), and
    docs/cni-and-agent.md shows exactly that entry; ``--plugin-config`` replaces settings, and one
    the plugin would refuse fails the install naming it, with nothing written."""
    from redirect.cni.netconf import DEFAULTS, PluginConf

    conf_dir, bin_dir = tmp_path / "net.d", tmp_path / "bin"
    conf_dir.mkdir()
    path = conf_dir / "10-net.conflist"
    path.write_text(CONFLISTS["indented"])
    exe = [sys.executable, "-m", "redirect.cni.plugin", "install", "--conf-dir", str(conf_dir), "--bin-dir",
           str(bin_dir)]
    env = {k: v for k, v in os.environ.items() if k != "CNI_COMMAND"}
    p = subprocess.run(exe, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    (entry,) = [e for e in json.loads(path.read_text())["plugins"] if e["type"] == "redirect-cni"]
    assert entry == _documented_entry()
    assert set(entry) == {"type", "capabilities", *DEFAULTS}
    written, bare = PluginConf({"cniVersion": "1.0.0", **entry}), PluginConf({"cniVersion": "1.0.0"})
    for attr in ("backend", "mode", "capture", "exclude_namespaces", "log_level", "log_file", "log_json",
                 "agent_timeout", "agent_down"):
        assert getattr(written, attr) == getattr(bare, attr), attr
    assert bare.exclude_namespaces == ("kube-system",) and written.agent_socket == "/run/redirect/agent.sock"
    p = subprocess.run([*exe, "--plugin-config", '{"excludeNamespaces": [], "capture": {"outbound_ports": [443]}}'],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    (entry2,) = [e for e in json.loads(path.read_text())["plugins"] if e["type"] == "redirect-cni"]
    assert entry2 == {**entry, "excludeNamespaces": [], "capture": {"outbound_ports": [443]}}
    before = path.read_bytes()
    for bad, field in (('{"excludeNamespaces": "kube-system"}', "excludeNamespaces"),
                       ('{"capture": {"proxy_port": 0}}', "capture.proxy_port"),
                       ('{"agentDown": "wait"}', "agentDown"),
                       ('{"backend": "bogus"}', "backend='bogus'"),
                       ('{"backend": "ebpf", "capture": {"drop_invalid": true}}', "drop_invalid")):
        p = subprocess.run([*exe, "--plugin-config", bad, "--watch"], capture_output=True, text=True, timeout=60,
                           env=env)
        assert p.returncode == 1 and field in p.stderr, (bad, p.stderr)
        assert path.read_bytes() == before


def test_single_conf_becomes_conflist_and_comes_back(tmp_path: Any) -> None:
    original = b'{"cniVersion": "0.3.1", "name": "mynet", "type": "bridge", "bridge": "cni0",\n "ipam": {}}\n'
    conf = tmp_path / "10-mynet.conf"
    conf.write_bytes(original)
    os.chmod(conf, 0o640)
    target = inst.install(str(tmp_path), None)
    assert target == str(tmp_path / "10-mynet.conflist") and not conf.exists()
    doc = json.loads((tmp_path / "10-mynet.conflist").read_text())
    assert doc["cniVersion"] == "0.3.1" and doc["name"] == "mynet"
    assert [p["type"] for p in doc["plugins"]] == ["bridge", "redirect-cni"]
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert inst.install(str(tmp_path), None) is None  # the mark is kept, nothing changes
    inst.uninstall(str(tmp_path), None)
    assert os.listdir(tmp_path) == ["10-mynet.conf"]
    assert conf.read_bytes() == original and stat.S_IMODE(conf.stat().st_mode) == 0o640


def test_standalone_and_errors(tmp_path: Any) -> None:
    with pytest.raises(inst.InstallError, match="no network config"):
        inst.install(str(tmp_path), None)
    (tmp_path / "00-bad.conflist").write_text("{not json")
    with pytest.raises(inst.InstallError, match="not valid JSON"):
        inst.install(str(tmp_path), None)
    (tmp_path / "00-bad.conflist").unlink()
    path = inst.install(str(tmp_path), None, standalone="50-redirect.conflist", primary=[{"type": "loopback"}])
    assert [p["type"] for p in json.loads(open(path).read())["plugins"]] == ["loopback", "redirect-cni"]
    inst.uninstall(str(tmp_path), None)
    assert os.listdir(tmp_path) == []


def test_watch_re_adds_after_another_tool_rewrites(tmp_path: Any) -> None:
    path = tmp_path / "10-net.conflist"
    path.write_text(CONFLISTS["compact"])
    stop = threading.Event()
    seen: list[str] = []
    t = threading.Thread(target=inst.watch, args=(stop, str(tmp_path), None),
                         kwargs={"interval": 0.05, "max_seconds": 10, "on_install": seen.append}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 5
        while len(seen) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        path.write_text(CONFLISTS["compact"])  # the primary CNI rewrites its file
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive()
    assert len(seen) == 2
    assert json.loads(path.read_text())["plugins"][-1]["type"] == "redirect-cni"


def test_watch_puts_back_a_removed_or_replaced_binary(tmp_path: Any) -> None:
    (tmp_path / "10-net.conflist").write_text(CONFLISTS["compact"])
    bin_dir = tmp_path / "bin"
    thin, launcher = bin_dir / "redirect-cni", bin_dir / "redirect-cni-python"
    stop = threading.Event()
    seen: list[str] = []
    t = threading.Thread(target=inst.watch, args=(stop, str(tmp_path), str(bin_dir)),
                         kwargs={"interval": 0.05, "max_seconds": 10, "on_install": seen.append}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 5

        def wait_for(n: int) -> None:
            while len(seen) < n and time.monotonic() < deadline:
                time.sleep(0.02)

        wait_for(3)  # both binaries and the entry
        assert sorted(seen) == sorted([str(thin), str(launcher), str(tmp_path / "10-net.conflist")])
        thin.unlink()  # removed
        wait_for(4)
        thin.write_bytes(b"#!/bin/sh\nexit 0\n")  # replaced by something else
        wait_for(5)
        launcher.unlink()
        wait_for(6)
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive()
    assert seen[3:] == [str(thin), str(thin), str(launcher)]
    assert thin.read_bytes() == open(inst.THIN_BINARY, "rb").read() and os.access(thin, os.X_OK)
    assert launcher.read_text().startswith(f"#!{sys.executable}")


def test_cli_install_uninstall(tmp_path: Any) -> None:
    (tmp_path / "10-net.conflist").write_text(CONFLISTS["empty"])
    env = {k: v for k, v in os.environ.items() if k != "CNI_COMMAND"}
    args = ["--conf-dir", str(tmp_path), "--bin-dir", str(tmp_path / "bin")]
    p = subprocess.run([PLUGIN, "install", *args, "--plugin-config", '{"logLevel": "debug"}'],
                       env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "10-net.conflist").read_text())["plugins"][0]["logLevel"] == "debug"
    p = subprocess.run([PLUGIN, "uninstall", *args], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "10-net.conflist").read_text() == CONFLISTS["empty"]


def test_cli_watch_keeps_the_standalone_conflist_and_the_python_it_was_given(tmp_path: Any) -> None:
    """``install --watch`` with ``--standalone``, ``--primary`` and ``--python``: what it writes and
    puts back is what ``install`` with them writes (they were ignored: it added to the active file
    and wrote a launcher for its own interpreter)."""
    (tmp_path / "10-net.conflist").write_text(CONFLISTS["empty"])
    env = {k: v for k, v in os.environ.items() if k != "CNI_COMMAND"}
    bin_dir = tmp_path / "bin"
    args = ["--conf-dir", str(tmp_path), "--bin-dir", str(bin_dir), "--standalone", "50-redirect.conflist",
            "--primary", '[{"type": "loopback"}]', "--python", "/usr/bin/python3"]
    p = subprocess.run([PLUGIN, "install", *args, "--watch", "--interval", "0.05", "--max-seconds", "1"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "10-net.conflist").read_text() == CONFLISTS["empty"]  # not touched
    own = json.loads((tmp_path / "50-redirect.conflist").read_text())
    assert [e["type"] for e in own["plugins"]] == ["loopback", "redirect-cni"]
    assert (bin_dir / "redirect-cni-python").read_text().startswith("#!/usr/bin/python3 ")
    watched = (tmp_path / "50-redirect.conflist").read_bytes()
    assert subprocess.run([PLUGIN, "install", *args], env=env, capture_output=True, text=True,
                          timeout=30).stdout.strip() == "redirect-cni already installed"
    assert (tmp_path / "50-redirect.conflist").read_bytes() == watched


def test_converting_a_conf_never_replaces_a_conflist_of_the_same_name(tmp_path: Any) -> None:
    """A single ``10-net.conf`` whose ``.conflist`` name is taken by another file: install refuses
    (it used to overwrite that file), and writes nothing."""
    conf = tmp_path / "10-net.conf"
    conf.write_text('{"cniVersion": "1.0.0", "name": "net", "type": "bridge"}\n')
    other = tmp_path / "10-net.conflist"
    other.write_text('{"cniVersion": "1.0.0", "name": "other", "plugins": [{"type": "ptp"}]}\n')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(inst.InstallError, match="would replace .*10-net.conflist, which exists"):
        inst.install(str(tmp_path), None)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_uninstall_skips_a_file_it_cannot_undo_and_does_the_others(tmp_path: Any, caplog: Any) -> None:
    """A conf-dir file nested too deeply to read, and ours whose ``redirectInstall.original`` is not
    base64: each is left as it is with a warning (uninstall crashed on them and stopped); the
    other files lose our entry."""
    (tmp_path / "00-deep.conflist").write_text('{"plugins": ' + "[" * 100_000 + "]" * 100_000 + "}")
    conf = tmp_path / "10-net.conf"
    conf.write_text('{"cniVersion": "1.0.0", "name": "net", "type": "bridge"}\n')
    inst.install(str(tmp_path), None, conf_file="10-net.conf")
    mangled = tmp_path / "10-net.conflist"
    doc = json.loads(mangled.read_text())
    doc["plugins"][-1]["redirectInstall"]["original"] = "not base64!"
    mangled.write_text(json.dumps(doc))
    (tmp_path / "20-net.conflist").write_text(CONFLISTS["empty"])
    inst.install(str(tmp_path), None, conf_file="20-net.conflist")
    left = {p: (tmp_path / p).read_bytes() for p in ("00-deep.conflist", "10-net.conflist")}
    with caplog.at_level("WARNING", logger="redirect.cni.install"):
        assert inst.uninstall(str(tmp_path), None) == [str(tmp_path / "20-net.conflist")]
    assert (tmp_path / "20-net.conflist").read_text() == CONFLISTS["empty"]
    assert {p: (tmp_path / p).read_bytes() for p in left} == left
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "00-deep.conflist" in warned and "10-net.conflist" in warned and "not base64" in warned, warned
    env = {k: v for k, v in os.environ.items() if k != "CNI_COMMAND"}
    p = subprocess.run([PLUGIN, "uninstall", "--conf-dir", str(tmp_path), "--bin-dir", str(tmp_path / "bin")],
                       env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "left as it is" in p.stderr, p.stderr


def test_cli_install_reports_undecodable_input_and_touches_nothing(tmp_path: Any) -> None:
    """A --plugin-config file that is not UTF-8, JSON nested too deeply, and a conflist in the
    conf dir that does not decode: exit 1 with a message naming what, no traceback, no config changed."""
    conf = tmp_path / "10-net.conflist"
    conf.write_text(CONFLISTS["empty"])
    latin1 = tmp_path / "plugin.json"
    latin1.write_bytes(b'{"logLevel": "caf\xe9"}')
    env = {k: v for k, v in os.environ.items() if k != "CNI_COMMAND"}
    args = ["install", "--conf-dir", str(tmp_path), "--bin-dir", str(tmp_path / "bin")]
    for extra, words in (([f"--plugin-config=@{latin1}"], "not UTF-8"),
                         (["--plugin-config=" + "[" * 50_000], "nested too deeply"),
                         (["--primary=" + "[" * 50_000, "--standalone", "x"], "nested too deeply")):
        p = subprocess.run([PLUGIN, *args, *extra], env=env, capture_output=True, text=True, timeout=30)
        assert p.returncode == 1 and words in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert conf.read_text() == CONFLISTS["empty"]
    conf.write_text("[" * 100_000)
    p = subprocess.run([PLUGIN, *args], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "nested too deeply" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert conf.read_text() == "[" * 100_000


# --- the plugin against a real netns ---------------------------------------------------------------

PREV = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "x"}],
        "ips": [{"address": "10.250.0.2/24", "interface": 0}], "dns": {}}


def netconf(version: str = "1.0.0", prev: dict[str, Any] | None = PREV, **ours: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {"cniVersion": version, "name": "rdrt-test", "type": "redirect-cni", **ours}
    if prev is not None:
        conf["prevResult"] = convert_result(prev, version)
    return conf


def cni_proc(command: str, conf: dict[str, Any] | bytes, netns: str = "", args: str = "",
             container: str = "ctr1", extra_env: dict[str, str] | None = None,
             cwd: str | None = None) -> subprocess.CompletedProcess[bytes]:
    """The plugin executable run as a runtime runs it: CNI env vars, the config on stdin."""
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CNI_COMMAND": command,
           "CNI_CONTAINERID": container, "CNI_NETNS": netns, "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni",
           "CNI_ARGS": args, **(extra_env or {})}
    data = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    return subprocess.run([PLUGIN], input=data, env=env, capture_output=True, timeout=30, cwd=cwd)


def cni(command: str, conf: dict[str, Any] | bytes, netns: str = "", args: str = "",
        container: str = "ctr1", extra_env: dict[str, str] | None = None,
        cwd: str | None = None) -> tuple[int, dict[str, Any] | None]:
    p = cni_proc(command, conf, netns, args, container, extra_env, cwd)
    out = json.loads(p.stdout) if p.stdout.strip() else None
    return p.returncode, out


def ours_installed(netns: str) -> bool:
    text = ""
    for tool in ("iptables-save", "ip6tables-save", "iptables-legacy-save", "ip6tables-legacy-save"):
        text += subprocess.run(["ip", "netns", "exec", netns, tool], capture_output=True, text=True).stdout
    return "RDR_" in text


def where(pod: Pod, port: int, *listeners: TcpListener) -> tuple[str | None, Any]:
    hit = landing(pod.name, pod.peer_ip4, port, *listeners)
    return hit.label, hit.orig_dst


def test_version() -> None:
    rc, out = cni("VERSION", {"cniVersion": "0.4.0"})
    assert rc == 0
    assert out == {"cniVersion": "0.4.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]}


def test_add_check_del_captures_and_cleans_up(pod: Pod) -> None:
    conf = netconf()
    with TcpListener(pod.name, 15001, label="proxy") as proxy, TcpListener(pod.peer_name, 8080, label="app") as app:
        assert where(pod, 8080, proxy, app)[0] == "app"
        t0 = time.perf_counter()
        rc, out = cni("ADD", conf, pod.path)
        add_ms = (time.perf_counter() - t0) * 1e3
        assert rc == 0, out
        assert out == PREV  # prevResult passed through unchanged
        assert where(pod, 8080, proxy, app) == ("proxy", (pod.peer_ip4, 8080))
        assert cni("ADD", conf, pod.path)[0] == 0  # a repeated ADD is harmless
        assert cni("CHECK", conf, pod.path) == (0, None)
        assert cni("DEL", conf, pod.path) == (0, None)
        assert not ours_installed(pod.name)
        assert where(pod, 8080, proxy, app)[0] == "app"
        assert cni("DEL", conf, pod.path) == (0, None)  # idempotent
    print(f"ADD latency (exec + setup): {add_ms:.0f} ms")


def test_add_converts_prev_result_to_old_versions(pod: Pod) -> None:
    for version in ("0.3.1", "0.4.0"):
        rc, out = cni("ADD", netconf(version), pod.path)
        assert rc == 0 and out is not None
        assert out["cniVersion"] == version and out["ips"][0]["version"] == "4"
    assert cni("CHECK", netconf("0.3.1"), pod.path)[1]["code"] == 1  # type: ignore[index]
    assert cni("DEL", netconf("0.3.1"), pod.path)[0] == 0


def test_check_finds_tampering(pod: Pod) -> None:
    conf = netconf()
    assert cni("ADD", conf, pod.path)[0] == 0
    subprocess.run(["ip", "netns", "exec", pod.name, "iptables", "-t", "nat", "-F", "RDR_OUTPUT"], check=False)
    subprocess.run(["ip", "netns", "exec", pod.name, "iptables-legacy", "-t", "nat", "-F", "RDR_OUTPUT"],
                   check=False, capture_output=True)
    rc, out = cni("CHECK", conf, pod.path)
    assert rc == 1 and out is not None and out["code"] == 104 and out["details"]
    assert cni("DEL", conf, pod.path)[0] == 0


def test_del_when_netns_is_gone() -> None:
    assert cni("DEL", netconf(), "/run/netns/rdrt-does-not-exist") == (0, None)
    assert cni("DEL", netconf(), "") == (0, None)


def test_del_with_a_bare_netns_name_from_another_cwd_removes_the_rules(pod: Pod, tmp_path: Any) -> None:
    """ADD and DEL resolve CNI_NETNS alike: a bare name is one under /run/netns, wherever the
    runtime runs the plugin from (DEL used to look the name up in its cwd, find nothing, and leave
    the rules)."""
    conf = netconf()
    assert cni("ADD", conf, pod.name, cwd=str(tmp_path)) == (0, PREV)
    assert ours_installed(pod.name)
    assert cni("CHECK", conf, pod.name, cwd="/") == (0, None)
    assert cni("DEL", conf, pod.name, cwd=str(tmp_path)) == (0, None)
    assert not ours_installed(pod.name)
    assert cni("DEL", conf, pod.name, cwd=str(tmp_path)) == (0, None)  # idempotent
    assert cni("DEL", conf, "rdrt-no-such-netns", cwd=str(tmp_path)) == (0, None)


@pytest.mark.parametrize("prev,words", [
    ({"cniVersion": "1.0.0", "ips": "10.0.0.1/24"}, "prevResult.ips="),
    ({"cniVersion": "1.0.0", "ips": {"address": "10.0.0.1/24"}}, "prevResult.ips="),
    ({"cniVersion": "1.0.0", "ips": [1]}, "prevResult.ips[0]=1"),
    ({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.1/24"}, {"address": 5}]}, "prevResult.ips[1].address=5"),
    ({"cniVersion": "1.0.0", "ips": [{"address": "not-an-ip"}]}, "prevResult.ips[0].address='not-an-ip'"),
    ({"cniVersion": "1.0.0", "ips": [{"interface": 0}]}, "prevResult.ips[0].address=None"),
    (["10.0.0.1/24"], "prevResult=['10.0.0.1/24']"),
    ({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2"}]}, "prevResult.ips[0].address='10.0.0.2'"),
    ({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/24"}, {"address": "10.0.0.3/255.255.255.0"}]},
     "prevResult.ips[1].address='10.0.0.3/255.255.255.0'"),
    ({"cniVersion": "1.0.0", "ips": [{"address": "fe80::1%eth0/64"}]}, "prevResult.ips[0].address='fe80::1%eth0/64'"),
    ({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/33"}]}, "prevResult.ips[0].address='10.0.0.2/33'"),
    ({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/+8"}]}, "prevResult.ips[0].address='10.0.0.2/+8'"),
], ids=["ips-str", "ips-obj", "ip-int", "address-int", "address-junk", "address-missing", "not-an-object",
        "no-prefix", "netmask", "zone", "prefix-too-long", "signed-prefix"])
def test_a_malformed_prev_result_is_error_4_with_a_message(pod: Pod, prev: Any, words: str) -> None:
    conf = netconf(prev=None)
    conf["prevResult"] = prev
    for version in ("1.0.0", "0.4.0"):
        conf["cniVersion"] = version
        p = cni_proc("ADD", conf, pod.path)
        out = json.loads(p.stdout)
        assert p.returncode == 1 and out["code"] == 4 and words in out["msg"], out
        assert b"Traceback" not in p.stderr, p.stderr.decode()[-2000:]
    assert not ours_installed(pod.name)


def test_bad_annotation_fails_closed(pod: Pod) -> None:
    enc = encode_annotations({T + "excludeOutboundPorts": "22,ssh"})
    args = f"K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;REDIRECT_ANNOTATIONS={enc}"
    rc, out = cni("ADD", netconf(), pod.path, args=args)
    assert rc == 1 and out is not None and out["code"] == 101
    assert T + "excludeOutboundPorts" in out["msg"] and "22,ssh" in out["msg"] and "default/web" in out["msg"]
    assert not ours_installed(pod.name)
    conf = netconf(runtimeConfig={"io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/interceptionMode": "X"}})
    rc, out = cni("ADD", conf, pod.path)
    assert rc == 1 and out is not None and out["code"] == 101 and "interceptionMode" in out["msg"]
    assert not ours_installed(pod.name)


def test_annotations_from_runtime_config_apply(pod: Pod) -> None:
    conf = netconf(runtimeConfig={"io.kubernetes.cri.pod-annotations": {T + "excludeOutboundPorts": "8081"}})
    with TcpListener(pod.name, 15001, label="proxy") as proxy, \
            TcpListener(pod.peer_name, 8080, label="app") as app, TcpListener(pod.peer_name, 8081, label="db") as db:
        assert cni("ADD", conf, pod.path)[0] == 0
        assert where(pod, 8080, proxy, app, db)[0] == "proxy"
        assert where(pod, 8081, proxy, app, db)[0] == "db"
        assert cni("CHECK", conf, pod.path)[0] == 0
        assert cni("DEL", conf, pod.path)[0] == 0


def test_null_annotations_are_none_as_containerd_sends_them(pod: Pod) -> None:
    """containerd's CRI passes ``null`` as the pod annotations of a pod that has none: captured
    with the entry's config, like a pod with ``{}``."""
    conf = netconf(runtimeConfig={"io.kubernetes.cri.pod-annotations": None})
    with TcpListener(pod.name, 15001, label="proxy") as proxy, \
            TcpListener(pod.peer_name, 8080, label="app") as app, TcpListener(pod.peer_name, 8081, label="db") as db:
        assert cni("ADD", conf, pod.path, args="K8S_POD_NAMESPACE=default;K8S_POD_NAME=web")[0] == 0
        assert where(pod, 8080, proxy, app, db)[0] == "proxy"
        assert cni("DEL", conf, pod.path)[0] == 0
    assert not ours_installed(pod.name)


def test_a_pod_redirect_inject_gave_its_init_container_is_left_to_it(pod: Pod) -> None:
    """A pod carrying ``redirect/inject-status`` gets its capture from its own init container: the
    plugin installs nothing, in either mode (ambient capture would stack on the sidecar's)."""
    status = {"redirect/inject-status": '{"initContainers":["redirect-init"]}'}
    for mode in ("sidecar", "ambient"):
        conf = netconf(mode=mode, runtimeConfig={"io.kubernetes.cri.pod-annotations": status})
        rc, out = cni("ADD", conf, pod.path, args="K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web")
        assert rc == 0 and out == PREV and not ours_installed(pod.name), (mode, out)


def test_excluded_namespace_and_opt_out_are_not_captured(pod: Pod) -> None:
    kube_system = "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns"
    for conf in (netconf(), netconf(excludeNamespaces=["kube-system"])):  # kube-system by default, as Istio's CNI
        rc, out = cni("ADD", conf, pod.path, args=kube_system)
        assert rc == 0 and out == PREV and not ours_installed(pod.name)
    conf = netconf(excludeNamespaces=["shop"])
    assert cni("ADD", conf, pod.path, args="K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web") == (0, PREV)
    assert not ours_installed(pod.name)
    conf = netconf(excludeNamespaces=[])  # none excluded: kube-system pods are captured too
    assert cni("ADD", conf, pod.path, args=kube_system) == (0, PREV) and ours_installed(pod.name)
    assert cni("DEL", conf, pod.path, args=kube_system) == (0, None) and not ours_installed(pod.name)
    conf = netconf(args={"cni": {"annotations": {"sidecar.istio.io/inject": "false"}}})
    assert cni("ADD", conf, pod.path) == (0, PREV) and not ours_installed(pod.name)


def _nested(depth: int) -> bytes:
    head = b'{"cniVersion": "1.0.0", "name": "x", "type": "redirect-cni", "capture": '
    return head + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("conf,code", [
    (b"{not json", 6),
    (b"[" * 100_000 + b"]" * 100_000, 6),  # nested too deeply for the JSON decoder
    (_nested(100_000), 6),
    (b'{"cniVersion": "1.0.0", "name": "\xff"}', 6),
    (json.dumps(netconf()).encode() + b" " * (1 << 20), 6),  # over MAX_STDIN
    (json.dumps(netconf(capture={"outbound_ports": [[[[[["x"] * 50] * 50] * 50]]]})).encode(), 4),
    (json.dumps({"cniVersion": "0.2.0", "name": "x", "type": "redirect-cni"}).encode(), 1),
    (json.dumps(netconf(capture={"proxy_port": 0})).encode(), 4),
    (json.dumps(netconf(capture={"no_such_field": 1})).encode(), 4),
    (json.dumps(netconf(mode="both")).encode(), 4),
    (json.dumps(netconf(backend="nope")).encode(), 102),
])
def test_config_errors_have_cni_codes(pod: Pod, conf: bytes, code: int) -> None:
    p = cni_proc("ADD", conf, pod.path)
    out = json.loads(p.stdout)
    assert p.returncode == 1 and out["code"] == code and out["msg"], out
    assert set(out) == {"cniVersion", "code", "msg", "details"}
    assert len(out["msg"]) + len(out["details"]) < 2000 and b"Traceback" not in p.stderr
    assert not ours_installed(pod.name)


def test_env_errors_status_and_gc(pod: Pod) -> None:
    rc, out = cni("ADD", netconf(), "")
    assert rc == 1 and out is not None and out["code"] == 7 and "CNI_NETNS" in out["msg"]
    rc, out = cni("ADD", netconf(), "/run/netns/rdrt-does-not-exist")
    assert rc == 1 and out is not None and out["code"] == 7
    rc, out = cni("ADD", netconf(), pod.path, args="garbage")
    assert rc == 1 and out is not None and out["code"] == 7
    assert cni("BOGUS", netconf())[1]["code"] == 7  # type: ignore[index]
    assert cni("STATUS", netconf("1.1.0")) == (0, None)
    for backend in ("iptablesx", "iptables ", "nope"):  # what every ADD would refuse (102): not available
        rc, out = cni("STATUS", netconf("1.1.0", backend=backend))
        assert rc == 1 and out is not None and out["code"] == 50 and repr(backend) in out["msg"], out
    rc, out = cni("STATUS", netconf("1.1.0", mode="ambient", agentSocket="/run/rdrt-no-agent.sock"))
    assert rc == 1 and out is not None and out["code"] == 50
    assert cni("GC", netconf("1.1.0")) == (0, None)


def test_ambient_add_fails_closed_when_no_agent_listens(pod: Pod) -> None:
    """No agent at agentSocket: the ADD fails (11, try again later) at once and nothing is installed in the pod."""
    rc, out = cni("ADD", netconf(mode="ambient", agentSocket="/run/rdrt-no-agent-here.sock", agentTimeout=2),
                  pod.path)
    assert rc == 1 and out is not None and out["code"] == 11 and "node agent" in out["msg"], out
    assert not ours_installed(pod.name)


def test_ebpf_backend_del_of_a_gone_netns_and_gc_collect_its_host_entries(make_pod: Any) -> None:
    """With ``backend: "ebpf"`` a pod's state is in host maps, keyed by netns cookie: a pod whose netns
    went without a DEL is collected by GC (or by a later DEL whose netns is gone); the live pod stays
    captured. The host programs go to a scratch bpffs root, removed at the end."""
    from redirect.backends import ebpf
    from redirect.kernel import netns as rn
    from tests import netkit

    root = f"/sys/fs/bpf/rdrt-cni-{os.getpid()}"
    env = {"REDIRECT_BPF_ROOT": root}
    conf = netconf("1.1.0", backend="ebpf", capture={"inbound_ports": []})
    live, gone, later = make_pod(), make_pod(), make_pod()

    def cookie(p: Pod) -> int:
        with rn.enter(p.name):
            return ebpf.current_netns_cookie()

    try:
        for i, p in enumerate((live, gone, later)):
            rc, out = cni("ADD", conf, p.path, container=f"ctr-e{i}", extra_env=env)
            assert rc == 0, out
        cookies = {p.name: cookie(p) for p in (live, gone, later)}
        assert sorted(ebpf.registered_pods(root)) == sorted(cookies.values())
        with TcpListener(live.name, 15001, label="proxy") as proxy, \
                TcpListener(live.peer_name, 8080, label="app") as app:
            assert landing(live.name, live.peer_ip4, 8080, proxy, app, uid=1000).listener is proxy
        netkit.remove_netns(gone.name)  # the runtime lost it: no DEL came
        netkit.remove_netns(gone.peer_name)
        netkit.wait_link_detached(root, cookies[gone.name])
        assert cni("GC", conf, extra_env=env) == (0, None)
        assert sorted(ebpf.registered_pods(root)) == sorted([cookies[live.name], cookies[later.name]])
        netkit.remove_netns(later.name)  # its DEL comes after the netns went
        netkit.remove_netns(later.peer_name)
        netkit.wait_link_detached(root, cookies[later.name])
        assert cni("DEL", conf, later.path, container="ctr-e2", extra_env=env) == (0, None)
        assert ebpf.registered_pods(root) == [cookies[live.name]]
        assert cni("DEL", conf, live.path, container="ctr-e0", extra_env=env) == (0, None)
        assert ebpf.registered_pods(root) == []
    finally:
        ebpf.force_unload_host(root)
    assert not os.path.exists(root)
