"""``--log-json``: every executable logs one JSON object per line through ``redirect.logjson``.

Each executable runs as a real process (the CLI against a real pod netns, the CNI plugin's
ADD on one, the installer on a conf dir, the agent and the node proxy started and stopped),
and every line it writes must parse as one JSON object with time, level, logger and msg.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from redirect import logjson
from tests.netkit import Pod

BIN = os.path.dirname(sys.executable)
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every non-empty line parsed; fails on the first line that is not one JSON object."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        assert isinstance(rec, dict), line
        assert list(rec)[:4] == ["time", "level", "logger", "msg"], rec
        assert TIME.match(rec["time"]) and rec["level"] in ("debug", "info", "warning", "error", "critical"), rec
        out.append(rec)
    assert out, "no log lines"
    return out


def env_without_istio(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("ISTIO_", "REDIRECT_FAULT", "POD_", "CNI_"))}
    e.update(extra)
    return e


# --- the formatter -----------------------------------------------------------------------------


def test_a_record_is_one_line_with_the_pod_fields_bounded() -> None:
    out = io.StringIO()
    logjson.setup(json_lines=True, level="debug", logger="rdrt-test", stream=out,
                  pod=logjson.pod_fields(pod_name="web\nx" + "a" * 1000, pod_namespace="default",
                                         netns="/proc/1/ns/net"))
    log = logging.getLogger("rdrt-test.sub")
    logjson.log_fields(log, logging.INFO, "two\nlines", port=15001, msg="not the message")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    logjson.setup(json_lines=True, logger="rdrt-test", stream=out)  # replaces our handler: no doubled lines
    log.warning("once")
    first, second, third = json_lines(out.getvalue())
    assert first["msg"] == "two\nlines" and first["logger"] == "rdrt-test.sub" and first["level"] == "info"
    assert first["port"] == 15001 and first["pod_namespace"] == "default" and first["netns"] == "/proc/1/ns/net"
    assert first["pod_name"].startswith("web\nx") and len(first["pod_name"]) <= logjson.MAX_FIELD + 10
    assert second["level"] == "error" and "ValueError: boom" in second["exc"]
    assert third["msg"] == "once" and "pod_name" not in third
    assert logjson.pod_fields_from_env({"POD_NAME": "a", "POD_NAMESPACE": "b", "POD_UID": ""}) == \
        {"pod_name": "a", "pod_namespace": "b"}
    logging.getLogger("rdrt-test").handlers.clear()


# --- redirect ----------------------------------------------------------------------------------


def test_redirect_cli_logs_json_lines_with_the_pod_fields(pod: Pod) -> None:
    env = env_without_istio(POD_NAME="web-0", POD_NAMESPACE="shop", POD_UID="u-1")
    p = subprocess.run([sys.executable, "-m", "redirect.cli", "--log-json", "-v", "setup", pod.name],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    recs = json_lines(p.stderr)
    assert all(r["pod_name"] == "web-0" and r["pod_namespace"] == "shop" and r["pod_uid"] == "u-1"
               and r["netns"] == pod.name for r in recs), recs
    p = subprocess.run([sys.executable, "-m", "redirect.cli", "--log-json", "teardown", pod.name],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    # a failure is a JSON line too (level error), and text without the flag
    p = subprocess.run([sys.executable, "-m", "redirect.cli", "--log-json", "show", "/nonexistent/netns"],
                       capture_output=True, text=True, timeout=60, env=env)
    (rec,) = json_lines(p.stderr)
    assert p.returncode == 1 and rec["level"] == "error" and "/nonexistent/netns" in rec["msg"], rec
    p = subprocess.run([sys.executable, "-m", "redirect.cli", "show", "/nonexistent/netns"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1 and p.stderr.startswith("redirect: ") and "{" not in p.stderr


def test_a_log_file_is_opened_only_where_no_other_user_can_redirect_it(tmp_path: Path) -> None:
    """What another user can put in the way of a log file (in a directory others may write) is
    refused at once, without waiting on a FIFO or writing where a symlink points."""
    nobody = 65534
    ww = tmp_path / "ww"
    ww.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(ww, 0o1777)  # as /tmp: sticky, anyone may add entries
    target = tmp_path / "target"
    target.write_text("root's\n")
    os.chmod(target, 0o644)

    def refused(path: Path, words: str) -> None:
        t0 = time.monotonic()
        try:
            logjson.open_log_file(str(path)).close()
        except OSError as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"{path} was opened")
        assert time.monotonic() - t0 < 5  # (a FIFO's open would wait for a reader for ever)

    fifo = ww / "fifo.log"
    os.mkfifo(fifo)
    os.chown(fifo, nobody, nobody)
    refused(fifo, "not a regular file")
    refused(Path("/dev/null"), "not a regular file")
    link = ww / "d"  # another user's symlink to a directory of root's
    os.symlink(tmp_path, link)
    os.lchown(link, nobody, nobody)
    refused(link / "target", "symlink of uid 65534")
    assert target.read_text() == "root's\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
    theirs = ww / "theirs"  # another user's directory: they may swap what is in it
    theirs.mkdir()
    os.chown(theirs, nobody, nobody)
    refused(theirs / "x.log", "owned by uid 65534")
    open_dir = tmp_path / "open"  # anyone may rename what is in it
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    refused(open_dir / "x.log", "writable by others")
    # in the sticky directory itself, and through a symlink of root's: opened, 0600
    with logjson.open_log_file(str(ww / "ok.log")) as f:
        f.write("line\n")
    assert stat.S_IMODE((ww / "ok.log").stat().st_mode) == 0o600
    os.symlink(tmp_path, tmp_path / "mine")
    with logjson.open_log_file(str(tmp_path / "mine" / "ok2.log")) as f:
        f.write("line\n")
    assert (tmp_path / "ok2.log").read_text() == "line\n"


# --- redirect-cni ------------------------------------------------------------------------------


def test_redirect_cni_plugin_and_installer_log_json_lines(pod: Pod, tmp_path: Path) -> None:
    log_file = tmp_path / "cni.log"
    conf = {"cniVersion": "1.0.0", "name": "rdrt-log", "type": "redirect-cni", "logJson": True,
            "logFile": str(log_file), "logLevel": "info",
            "prevResult": {"cniVersion": "1.0.0", "interfaces": [], "ips": [], "dns": {}}}
    args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_UID=u-1"
    for command in ("ADD", "DEL"):
        env = env_without_istio(CNI_COMMAND=command, CNI_CONTAINERID="ctr-1", CNI_NETNS=pod.path, CNI_IFNAME="eth0",
                                CNI_PATH="/usr/lib/cni", CNI_ARGS=args)
        p = subprocess.run([os.path.join(BIN, "redirect-cni")], input=json.dumps(conf), env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
    recs = json_lines(log_file.read_text())
    assert [r for r in recs if r["msg"].startswith("ADD ")] and [r for r in recs if r["msg"].startswith("DEL ")]
    for r in recs:
        assert (r["pod_name"], r["pod_namespace"], r["pod_uid"], r["container_id"], r["netns"]) == \
            ("web-0", "shop", "u-1", "ctr-1", pod.path), r
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600  # it names pods and addresses
    # a bad logJson is refused as a config error
    env = env_without_istio(CNI_COMMAND="ADD", CNI_CONTAINERID="ctr-1", CNI_NETNS=pod.path, CNI_IFNAME="eth0")
    p = subprocess.run([os.path.join(BIN, "redirect-cni")], input=json.dumps({**conf, "logJson": "yes"}), env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and json.loads(p.stdout)["code"] == 4 and "logJson" in json.loads(p.stdout)["msg"]

    net_d = tmp_path / "net.d"
    net_d.mkdir()
    (net_d / "10-a.conflist").write_text('{"cniVersion": "1.0.0", "name": "a", "plugins": [{"type": "bridge"}]}')
    for args2 in (["install"], ["uninstall"]):
        p = subprocess.run([os.path.join(BIN, "redirect-cni"), *args2, "--conf-dir", str(net_d), "--bin-dir",
                            str(tmp_path / "bin"), "--log-json"], env=env_without_istio(), capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 0 and not p.stdout, p.stdout + p.stderr
        (rec,) = json_lines(p.stderr)
        assert rec["logger"] == "redirect.cni.install" and str(net_d / "10-a.conflist") in rec["msg"], rec
    p = subprocess.run([os.path.join(BIN, "redirect-cni"), "install", "--conf-dir", str(tmp_path / "none"),
                        "--bin-dir", str(tmp_path / "bin"), "--log-json"], env=env_without_istio(),
                       capture_output=True, text=True, timeout=30)
    (rec,) = json_lines(p.stderr)
    assert p.returncode == 1 and rec["level"] == "error", rec


# --- redirect-agent and redirect-nodeproxy ------------------------------------------------------


def _run_until(argv: list[str], log: Path, done: str, timeout: float = 30) -> str:
    """Start ``argv`` (stderr to ``log``), wait for a line containing ``done``, SIGTERM it, return the log."""
    with open(log, "wb") as f:
        p = subprocess.Popen(argv, stderr=f, stdout=subprocess.DEVNULL, env=env_without_istio())
    try:
        deadline = time.monotonic() + timeout
        while done not in log.read_text():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    return log.read_text()


def test_redirect_agent_and_nodeproxy_log_json_lines(tmp_path: Path) -> None:
    agent = [os.path.join(BIN, "redirect-agent"), "--events-socket", str(tmp_path / "a.sock"), "--proxy-socket",
             str(tmp_path / "p.sock"), "--http-port", "0", "--no-host-rules", "--no-proc-scan",
             "--node-name", f"rdrt-log-{os.getpid()}"]
    recs = json_lines(_run_until([*agent, "--log-json"], tmp_path / "agent.log", "agent ready"))
    assert {"http listening", "agent ready", "agent stopped; redirection left in place"} <= {r["msg"] for r in recs}
    assert next(r for r in recs if r["msg"] == "http listening")["port"] > 0
    text = _run_until([*agent, "--no-log-json"], tmp_path / "agent-text.log", "agent ready")
    assert "INFO redirect.agent: agent ready" in text and not text.lstrip().startswith("{")

    proxy = [os.path.join(BIN, "redirect-nodeproxy"), "--socket", str(tmp_path / "none.sock")]
    recs = json_lines(_run_until([*proxy, "--log-json"], tmp_path / "proxy.log", '"started"'))
    started = next(r for r in recs if r["event"] == "started")
    assert started["msg"] == "started" and started["logger"] == "redirect.nodeproxy" and started["pid"] > 0
    text = _run_until([*proxy, "--no-log-json"], tmp_path / "proxy-text.log", " started ")
    assert "INFO redirect.nodeproxy: started socket=" in text
