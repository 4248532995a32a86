"""The ``redirect`` command line, run as a real process against real namespaces."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from typing import Any

import pytest

import redirect
from tests.netkit import Pod, TcpListener, landing

REDIRECT = [sys.executable, "-m", "redirect.cli"]
INJECTOR = ["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "", "-b", "*",
            "-d", "15090,15021,15020"]


def run(*args: str, env: dict[str, str] | None = None, cpu_seconds: int | None = None,
        memory: int | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a process; ``cpu_seconds``/``memory`` set RLIMIT_CPU/RLIMIT_AS on it."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("ISTIO_", "REDIRECT_FAULT"))}
    e.update(env or {})

    def limits() -> None:
        if cpu_seconds is not None:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([*REDIRECT, *args], capture_output=True, text=True, timeout=60, env=e, preexec_fn=limits)


def rules(ns: str) -> str:
    out = []
    for tool in ("iptables-save", "ip6tables-save", "iptables-legacy-save", "ip6tables-legacy-save"):
        p = subprocess.run(["ip", "netns", "exec", ns, tool], capture_output=True, text=True)
        out += [ln for ln in p.stdout.splitlines() if ln.startswith("-A")]
    return "\n".join(out)


def test_help_lists_the_commands() -> None:
    p = run("--help")
    assert p.returncode == 0
    for cmd in ("setup", "teardown", "check", "show", "init", "node", "ebpf"):
        assert cmd in p.stdout
    p = run("init", "--help")
    assert "--istio-service-cidr" in p.stdout and "ISTIO_SERVICE_CIDR" in p.stdout


def test_setup_check_show_teardown_round_trip(pod: Pod) -> None:
    p = run("setup", pod.name, "--set", "outbound_exclude_ports=22,80", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["changed"] is True and res["families"] == [4, 6]
    assert run("setup", pod.name, "--set", "outbound_exclude_ports=22,80", "--json").stdout.count('"changed": false')
    assert run("check", pod.name, "--set", "outbound_exclude_ports=22,80").returncode == 0
    drift = run("check", pod.name, "--json")
    assert drift.returncode == 1
    assert any("22" in d for d in json.loads(drift.stdout)["differences"])
    shown = json.loads(run("show", pod.name, "--json").stdout)
    assert shown["installed"] is True and shown["netns"] == pod.name
    text = run("show", pod.name).stdout
    assert "RDR_OUTBOUND" in text
    assert run("teardown", pod.name).returncode == 0
    assert "RDR_" not in rules(pod.name)
    assert json.loads(run("show", pod.name, "--json").stdout)["installed"] is False


def test_bad_config_exits_2_and_installs_nothing(pod: Pod, tmp_path: object) -> None:
    before = rules(pod.name)
    p = run("setup", pod.name, "--set", "proxy_port=0")
    assert p.returncode == 2
    assert "proxy_port" in p.stderr and "'0'" in p.stderr
    assert "Traceback" not in p.stderr
    p = run("setup", pod.name, "--set", "no_such_field=1")
    assert p.returncode == 2 and "unknown field" in p.stderr
    p = run("init", "--netns", pod.name, "-i", "10.0.0.0/33")
    assert p.returncode == 2 and "--istio-service-cidr" in p.stderr
    assert rules(pod.name) == before


def installed_state(ns: str) -> str:
    """Every rule of both families and variants, and lo's addresses: what setup could change."""
    lo = subprocess.run(["ip", "-n", ns, "addr", "show", "dev", "lo"], capture_output=True, text=True).stdout
    return rules(ns) + "\n" + lo


def test_hostile_input_exits_2_naming_the_field_and_value_and_installs_nothing(pod: Pod, tmp_path: Any) -> None:
    from tests.test_config import alias_bomb

    before = installed_state(pod.name)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"proxy_port: 15001\n# caf\xe9\n")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (300 * 1024))
    cases: list[tuple[list[str], list[str]]] = [
        (["--config", str(bomb)], ["outbound_ports", "'lol'"]),
        (["--config", "/dev/zero"], ["config='/dev/zero'", "a character device, not a regular file"]),
        (["--config", str(big)], [f"config='{big}'", "larger than"]),
        (["--config", str(latin1)], [f"config='{latin1}'", "not UTF-8"]),
        (["--set", "proxy_port=\u0661\u0665\u0660\u0660\u0662"], ["proxy_port", "'\u0661\u0665\u0660\u0660\u0662'"]),
        (["--mode", "ambient", "--set", "proxy_mark=1_3_3_7"], ["proxy_mark", "'1_3_3_7'"]),
        (["--set", "outbound_ports=" + "[" * 20_000], ["outbound_ports", "not a port"]),
    ] + [(["--set", f"exclude_interfaces={n}"], ["exclude_interfaces", f"'{n}'"]) for n in ("+", "l+", "-j")]
    for args, words in cases:
        p = run("setup", pod.name, *args, cpu_seconds=10, memory=1 << 30)
        assert p.returncode == 2, (args, p.returncode, p.stderr[-2000:])
        assert "Traceback" not in p.stderr and len(p.stderr) < 2000, p.stderr[-2000:]
        for w in words:
            assert w in p.stderr, (args, w, p.stderr)
    for flag, value in (("-c", "l+"), ("-c", "+"), ("--kube-virt-interfaces", "-j"),
                        ("-p", "\u0661\u0665\u0660\u0660\u0662"), ("--iptables-probe-port", "\u0661\u0665")):
        p = run("init", "--netns", pod.name, *INJECTOR, f"{flag}={value}")
        assert p.returncode == 2 and repr(value) in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert installed_state(pod.name) == before


def test_a_fifo_named_as_a_config_file_or_a_netns_is_refused_without_waiting_for_a_writer(
        pod: Pod, tmp_path: Any) -> None:
    """Opening a FIFO waits for a writer: nothing but a regular file is read as a config (or an
    input), and nothing but a network namespace is opened as one; each is refused at once."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    before = installed_state(pod.name)
    p = run("setup", pod.name, "--config", str(fifo))
    assert p.returncode == 2 and f"config='{fifo}'" in p.stderr and "a FIFO, not a regular file" in p.stderr, p.stderr
    p = run("inject", "-f", str(fifo))
    assert p.returncode == 2 and "--filename" in p.stderr and "a FIFO" in p.stderr, p.stderr
    for cmd in ("setup", "check", "show", "teardown"):
        p = run(cmd, str(fifo))
        assert p.returncode == 1 and f"{fifo} is a FIFO, not a network namespace" in p.stderr, (cmd, p.stderr)
    p = run("setup", "/dev/null")
    assert p.returncode == 1 and "a character device, not a network namespace" in p.stderr, p.stderr
    assert installed_state(pod.name) == before


def test_missing_netns_exits_1_with_a_clear_message() -> None:
    p = run("setup", "rdrt-does-not-exist")
    assert p.returncode == 1
    assert "no such namespace" in p.stderr


def test_dry_run_prints_rules_and_touches_nothing(pod: Pod) -> None:
    before = rules(pod.name)
    p = run("setup", pod.name, "--dry-run")
    assert p.returncode == 0
    assert "-A RDR_REDIRECT -p tcp" in p.stdout and "--to-ports 15001" in p.stdout
    p = run("init", "--netns", pod.name, "-n", *INJECTOR)
    assert p.returncode == 0 and "RDR_IN_REDIRECT" in p.stdout
    assert rules(pod.name) == before


def test_init_with_istio_flags_captures_and_validates(pod: Pod) -> None:
    p = run("init", "--netns", pod.name, *INJECTOR, "--run-validation")
    assert p.returncode == 0, p.stderr
    assert "captured on 15006" in p.stdout
    assert redirect.check(pod.name, redirect.RedirectConfig()).ok
    with TcpListener(pod.name, 15001, label="proxy-out") as proxy, TcpListener(pod.peer_name, 8080) as app:
        hit = landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=1000)
        assert hit.listener is proxy and hit.orig_dst == (pod.peer_ip4, 8080)
    p = run("init", "--netns", pod.name, "--cleanup-only")
    assert p.returncode == 0
    assert "RDR_" not in rules(pod.name)


def test_init_reads_env_vars_like_istio(pod: Pod) -> None:
    env = {"ISTIO_SERVICE_CIDR": "*", "ISTIO_INBOUND_PORTS": "*", "ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE": "8080"}
    p = run("init", "--network-namespace", pod.name, env=env)
    assert p.returncode == 0, p.stderr
    with TcpListener(pod.name, 15001, label="proxy-out") as proxy, TcpListener(pod.peer_name, 8080) as app:
        assert landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=1000).listener is app
    run("teardown", pod.name)


def test_validation_failure_exits_126(pod: Pod) -> None:
    p = run("init", "--netns", pod.name, "--run-validation", "--skip-rule-apply", "--probe-timeout", "1s")
    assert p.returncode == 126
    assert "validation failed" in p.stdout


@pytest.mark.parametrize("variant", ["legacy", "nft"])
def test_force_iptables_binary(pod: Pod, variant: str) -> None:
    p = run("init", "--netns", pod.name, *INJECTOR, "--force-iptables-binary", f"iptables-{variant}")
    assert p.returncode == 0, p.stderr
    out = subprocess.run(["ip", "netns", "exec", pod.name, f"iptables-{variant}-save"], capture_output=True,
                         text=True).stdout
    assert "RDR_OUTBOUND" in out
    run("teardown", pod.name)
