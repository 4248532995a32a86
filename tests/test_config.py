"""RedirectConfig validation: every bad value is a ConfigError naming the field and the value."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from redirect import ConfigError, RedirectConfig
from redirect.config import field_names
from redirect.istio.flags import add_arguments, config_from_istio_args, options_from_args, resolv_conf_servers

INJECTOR = ["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "", "-b", "*",
            "-d", "15090,15021,15020"]


def test_defaults_are_istio_injection_defaults() -> None:
    c = RedirectConfig()
    assert (c.proxy_port, c.inbound_port, c.tunnel_port, c.dns_port) == (15001, 15006, 15008, 15053)
    assert c.proxy_uids == (1337,) and c.proxy_gids == (1337,)
    assert c.inbound_ports == "*" and c.outbound_cidrs == "*"
    assert c.inbound_exclude_ports == (15090, 15021, 15020)
    assert (c.tproxy_mark, c.tproxy_route_table) == (1337, 133)
    assert (c.proxy_mark, c.proxy_mark_mask, c.conn_mark, c.route_table) == (0x539, 0xFFF, 0x111, 100)
    assert c.probe_snat_ipv4 == "169.254.7.127"
    assert c.ipv6 is None


def test_lists_accept_strings_and_normalise() -> None:
    c = RedirectConfig(outbound_exclude_ports="22, 80,22", outbound_exclude_cidrs="10.0.0.1/8, fd00::/8",
                       proxy_uids="1337,1000-2000,root", dns_servers=["10.0.0.10", "fd00::a"])
    assert c.outbound_exclude_ports == (22, 80)
    assert c.outbound_exclude_cidrs == ("10.0.0.0/8", "fd00::/8")
    assert c.proxy_uids == (1337, (1000, 2000), 0)
    assert c.dns_servers == ("10.0.0.10", "fd00::a")


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("proxy_port", 0, "not a port"),
        ("proxy_port", 70000, "not a port"),
        ("proxy_port", True, "not booleans"),
        ("inbound_port", "abc", "not a port"),
        ("inbound_ports", "*,80", "must stand alone"),
        ("inbound_exclude_ports", "*", "not allowed"),
        ("outbound_cidrs", "10.0.0.0/33", "not an IPv4 or IPv6 CIDR"),
        ("outbound_exclude_cidrs", "*", "not allowed"),
        ("proxy_uids", "nosuchuser-xyz", "known user name"),
        ("proxy_uids", "5-1", "range"),
        ("proxy_gids", -1, "out of range"),
        ("owner_groups", (), "empty"),
        ("exclude_interfaces", "eth0,bad name", "not a valid interface name"),
        ("exclude_interfaces", "lo", "lo"),
        ("reroute_interfaces", "x" * 16, "not a valid interface name"),
        ("inbound_interception", "NAT", "REDIRECT"),
        ("mode", "mesh", "sidecar"),
        ("dns_servers", "not-an-ip", "not an IP address"),
        ("ipv6", "maybe", "true or false"),
        ("ipv4_loopback_cidr", "10.0.0.0/8", "127.0.0.0/8"),
        ("tproxy_route_table", 254, "main"),
        ("proxy_mark", 0x1539, "outside proxy_mark_mask"),
        ("probe_snat_ipv4", "fd00::1", "IPv4"),
        ("tproxy_mark", 1338, "1338"),
    ],
)
def test_bad_values_name_the_field_and_the_value(field: str, value: Any, words: str) -> None:
    with pytest.raises(ConfigError) as ei:
        RedirectConfig(**{field: value})
    e = ei.value
    assert e.field == field
    assert words in str(e)
    assert field in str(e)


def test_mutually_exclusive_settings() -> None:
    with pytest.raises(ConfigError, match="owner_groups_exclude"):
        RedirectConfig(owner_groups=(1,), owner_groups_exclude=(2,))
    with pytest.raises(ConfigError, match="same port as proxy_port"):
        RedirectConfig(inbound_port=15001)
    with pytest.raises(ConfigError, match="also excluded"):
        RedirectConfig(exclude_interfaces=("eth1",), reroute_interfaces=("eth1",))
    with pytest.raises(ConfigError, match="proxy captures itself"):
        RedirectConfig(proxy_uids=(), proxy_gids=())


def test_json_yaml_and_dict_builders_round_trip() -> None:
    c = RedirectConfig(outbound_exclude_ports=(22,), proxy_uids=((1000, 2000),), dns_capture=True,
                       dns_servers=("10.0.0.10",))
    assert RedirectConfig.from_dict(c.to_dict()) == c
    assert RedirectConfig.from_json(json.dumps(c.to_dict())) == c
    assert RedirectConfig.from_yaml("outbound-exclude-ports: [22]\nproxy_uids: ['1000-2000']\n"
                                    "dns_capture: true\ndns_servers: 10.0.0.10\n") == c


def test_builders_reject_unknown_fields_and_bad_documents() -> None:
    with pytest.raises(ConfigError, match="unknown field"):
        RedirectConfig.from_dict({"proxyport": 1})
    with pytest.raises(ConfigError, match="not valid JSON"):
        RedirectConfig.from_json("{")
    with pytest.raises(ConfigError, match="mapping"):
        RedirectConfig.from_yaml("- a\n- b\n")


def test_a_key_given_twice_is_refused_naming_it(tmp_path: Any) -> None:
    """YAML and JSON alike: a config with a key twice is an error naming the key (not the last one
    silently winning), from text, from a file and through the CLI (exit 2, nothing installed)."""
    yaml_text = "mode: sidecar\noutbound_exclude_ports: [22]\nmode: ambient\n"
    json_text = '{"mode": "sidecar", "outbound_exclude_ports": [22], "mode": "ambient"}'
    for builder, text in ((RedirectConfig.from_yaml, yaml_text), (RedirectConfig.from_json, json_text)):
        with pytest.raises(ConfigError, match="duplicate key 'mode'"):
            builder(text)
    with pytest.raises(ConfigError, match="duplicate key 'mode' \\(line 3\\)"):
        RedirectConfig.from_yaml(yaml_text)
    with pytest.raises(ConfigError, match="duplicate key 'dup'"):  # nested objects too
        RedirectConfig.from_json('{"mode": "sidecar", "x": {"dup": 1, "dup": 2}}')
    for name, text in (("dup.yaml", yaml_text), ("dup.json", json_text)):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError, match="duplicate key 'mode'"):
            RedirectConfig.from_file(str(path))
        p = subprocess.run([sys.executable, "-m", "redirect.cli", "setup", "--dry-run", "--config", str(path),
                            "rdrt-none"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "duplicate key 'mode'" in p.stderr and not p.stdout, (p.stdout, p.stderr)
    # What YAML means by a merge is not a duplicate: a mapping's own key wins over a merged one.
    assert RedirectConfig.from_yaml("<<: {mode: sidecar}\nmode: ambient\n").mode == "ambient"


_hostile = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**40, max_value=2**40), st.floats(allow_nan=True),
    st.text(max_size=40), st.lists(st.one_of(st.integers(-5, 70000), st.text(max_size=12)), max_size=4),
    st.sampled_from(["*", "", "0", "65536", "1-2", "10.0.0.0/8", "::/0", "eth0", "lo", "a,b", " , ", "0x539"]),
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.dictionaries(st.sampled_from(field_names()), _hostile, max_size=5))
@example({"owner_groups": ["\x00"]})  # getgrnam raised ValueError (embedded null byte)
@example({"proxy_uids": ["a\x00b"]})
def test_hostile_configs_raise_only_config_error(data: dict[str, Any]) -> None:
    try:
        cfg = RedirectConfig.from_dict(data)
    except ConfigError as e:
        assert e.field  # names what was wrong
        return
    # What validated is self-consistent: validating it again changes nothing.
    assert RedirectConfig.from_dict(cfg.to_dict()) == cfg


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_hostile_documents_raise_only_config_error(text: str) -> None:
    for builder in (RedirectConfig.from_json, RedirectConfig.from_yaml):
        try:
            builder(text)
        except ConfigError:
            pass


# --------------------------------------------------------------------------- istio-iptables flags


def test_istio_injector_flags_give_the_default_config() -> None:
    assert config_from_istio_args(INJECTOR, env={}) == RedirectConfig()


def test_istio_dns_flags_keep_istios_gid_hairpin_and_the_library_default_differs() -> None:
    """istio-iptables' hairpin rule for proxy gids leaves only the tunnel port alone under DNS
    capture; ``redirect init`` renders it so, the library's default leaves 53 alone too (docs/api.md)."""
    import redirect

    init = config_from_istio_args([*INJECTOR, "--redirect-dns", "--capture-all-dns"], env={})
    lib = RedirectConfig(dns_capture=True, capture_all_dns=True)
    assert init == lib.replace(gid_hairpin_skips_dns=False)

    def hairpins(cfg: RedirectConfig) -> list[str]:
        return [ln for ln in redirect.render(cfg, backend="iptables").splitlines() if "hairpin" in ln]

    for ln in hairpins(init):
        assert ("--dports 53,15008" in ln) == ("--uid-owner" in ln), ln
        assert "--gid-owner" not in ln or "! --dport 15008" in ln, ln
    assert all("--dports 53,15008" in ln for ln in hairpins(lib))
    assert hairpins(init.replace(dns_capture=False)) == hairpins(RedirectConfig())  # only with DNS capture


def test_istio_bare_flags_capture_nothing_like_istio() -> None:
    c = config_from_istio_args([], env={})
    assert c.inbound_ports == () and c.outbound_cidrs == ()
    assert c.inbound_exclude_ports == ()


def test_istio_env_vars_are_fallbacks_and_flags_win() -> None:
    env = {"ISTIO_SERVICE_CIDR": "*", "ISTIO_INBOUND_PORTS": "8000", "ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE": "22",
           "ISTIO_META_DNS_CAPTURE": "true", "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE": "3000",
           "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR": "127.0.0.0/8", "INVALID_DROP": "true", "PROXY_UID": "1400",
           "REDIRECT_RESOLV_CONF": "/nonexistent"}
    c = config_from_istio_args(["-b", "9000"], env=env)
    assert c.outbound_cidrs == "*"
    assert c.inbound_ports == (9000,)
    assert c.outbound_exclude_ports == (22,)
    assert c.dns_capture and c.drop_invalid
    assert c.owner_groups_exclude == (3000,)
    assert c.ipv4_loopback_cidr == "127.0.0.0/8"
    assert c.proxy_uids == (1400,) and c.proxy_gids == (1400,)  # -g defaults to -u, as in Istio


def test_istio_flag_errors_name_the_flag() -> None:
    with pytest.raises(ConfigError) as ei:
        config_from_istio_args(["-p", "0"], env={})
    assert ei.value.field == "--envoy-port"
    with pytest.raises(ConfigError) as ei:
        config_from_istio_args(["-x", "*"], env={})
    assert ei.value.field == "--istio-service-exclude-cidr"
    with pytest.raises(ConfigError):
        config_from_istio_args(["--no-such-flag"], env={})


def test_resolv_conf_servers(tmp_path: Any) -> None:
    p = tmp_path / "resolv.conf"
    p.write_text("# comment\nnameserver 10.0.0.10\nnameserver fe80::1%eth0\nnameserver junk\nsearch x\n")
    assert resolv_conf_servers(str(p)) == ("10.0.0.10", "fe80::1")
    assert resolv_conf_servers(str(tmp_path / "missing")) == ()


# --------------------------------------------------------------------------- hostile input


def run_limited(code: str, cpu_seconds: int = 10, memory: int = 1 << 30) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter under RLIMIT_CPU and RLIMIT_AS: over either, it dies
    (SIGXCPU, or MemoryError), which the caller's assertions then see."""

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=limits)


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A ~0.5-0.7 KB YAML document whose list field expands to width**levels strings."""
    lines = ["outbound_ports:", "  - &a0 [" + ",".join(['"lol"'] * width) + "]"]
    lines += [f"  - &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_rejected_in_bounded_time_and_memory() -> None:
    text = alias_bomb()
    assert len(text) < 800
    p = run_limited("from redirect import RedirectConfig, ConfigError\n"
                    "try:\n    RedirectConfig.from_yaml(" + repr(text) + ")\n"
                    "except ConfigError as e:\n    print(len(str(e)), e.field)\n", cpu_seconds=10, memory=1 << 30)
    assert p.returncode == 0, p.stderr[-2000:]
    size, field = p.stdout.split()
    assert field == "outbound_ports" and int(size) < 1000


@pytest.mark.parametrize("value", [
    "x" * 1_000_000,
    list(range(100_000)),
    {"k" * 10_000: ["v" * 10_000] * 10_000},
    10**5000,
    b"\xff" * 1_000_000,
], ids=["str", "list", "dict", "int", "bytes"])
def test_error_messages_show_a_bounded_part_of_the_value(value: Any) -> None:
    with pytest.raises(ConfigError) as ei:
        RedirectConfig(mode=value)
    msg = str(ei.value)
    assert msg.startswith("mode=") and len(msg) < 1000
    assert "..." in msg or "<int of" in msg
    assert ei.value.value is value  # the value itself is kept for callers


def test_deduplicating_every_port_is_linear() -> None:
    """65,535 distinct ports (and as many ids and CIDRs) validate within a CPU-time limit that the
    quadratic membership test (~19 s for the ports alone) did not meet."""
    p = run_limited("from redirect import RedirectConfig\n"
                    "from redirect.plan import build_plan\n"
                    "ports = list(range(1, 65536))\n"
                    "c = RedirectConfig(outbound_exclude_ports=ports, inbound_ports=ports[:32000],\n"
                    "                   inbound_exclude_ports=','.join(map(str, ports[32000:])),\n"
                    "                   proxy_uids=list(range(65536)),\n"
                    "                   outbound_exclude_cidrs=[f'10.{i >> 8}.{i & 255}.0/24' for i in range(65536)])\n"
                    "assert len(c.outbound_exclude_ports) == 65535 and len(c.proxy_uids) == 65536\n"
                    "build_plan(RedirectConfig(inbound_ports=ports[:32000], inbound_exclude_ports=ports[32000:]))\n"
                    "print('ok')\n", cpu_seconds=8)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


@pytest.mark.parametrize("field,value", [
    ("proxy_port", "١٥٠٠٢"),  # Arabic-Indic digits: int() reads 15002
    ("proxy_port", "1_5001"),
    ("inbound_ports", "80,８０"),  # fullwidth digits
    ("outbound_exclude_ports", ["2_2"]),
    ("proxy_uids", "١٣٣٧"),
    ("proxy_gids", "1_337"),
    ("owner_groups_exclude", "1_0-2_0"),
    ("proxy_mark", "1_3_3_7"),
    ("proxy_mark", "0x5_39"),
    ("conn_mark", "٢٧٣"),
    ("tproxy_route_table", "1_33"),
])
def test_numbers_are_ascii_digits_only(field: str, value: Any) -> None:
    kw: dict[str, Any] = {field: value}
    if field in ("proxy_mark", "conn_mark"):
        kw["mode"] = "ambient"
    with pytest.raises(ConfigError) as ei:
        RedirectConfig(**kw)
    assert ei.value.field == field and repr(value) in str(ei.value)


def test_ascii_numbers_and_hex_marks_still_work() -> None:
    c = RedirectConfig(mode="ambient", proxy_port=" 15001 ", proxy_mark="0x539", conn_mark="273", route_table="100")
    assert (c.proxy_port, c.proxy_mark, c.conn_mark, c.route_table) == (15001, 0x539, 273, 100)
    c = RedirectConfig(proxy_uids="1337, 1000-2000", inbound_ports="080,8080")
    assert c.proxy_uids == (1337, (1000, 2000)) and c.inbound_ports == (80, 8080)


@pytest.mark.parametrize("name", [
    "+", "l+", "eth+", "-j", "!eth0", "eth*", "a,b", 'a"b', "a'b", "a\\b", ".", "..", "a/b", "a:b", "a b",
    "eth0\t", "é0", "eth\x00", "x" * 16, "",
])
@pytest.mark.parametrize("field", ["exclude_interfaces", "reroute_interfaces"])
def test_interface_names_are_what_the_kernel_and_iptables_take_literally(field: str, name: str) -> None:
    with pytest.raises(ConfigError) as ei:
        RedirectConfig(**{field: [name]})
    assert ei.value.field == field and "not a valid interface name" in str(ei.value)


def test_real_interface_names_are_accepted() -> None:
    names = ("eth0", "eth0.100", "br-1a2b3c4d5e6f", "k6t-eth0", "cali1a2b3c4d5e6", "vxlan.calico", "cilium_host",
             "x" * 15, "tap@1", "net1")
    assert RedirectConfig(exclude_interfaces=names).exclude_interfaces == names


def test_documents_are_size_limited_and_every_decode_failure_is_a_config_error(tmp_path: Any) -> None:
    from redirect.config import MAX_CONFIG_BYTES

    big = "# " + "x" * MAX_CONFIG_BYTES + "\n"
    for builder in (RedirectConfig.from_json, RedirectConfig.from_yaml):
        with pytest.raises(ConfigError, match="longer than"):
            builder(big)
    for text, words in (("[" * 100_000 + "]" * 100_000, "nested too deeply"), ("x: " + "1" * 5000, "not valid YAML"),
                        ("- a\n", "mapping"), ("{a: [}", "not valid YAML")):
        with pytest.raises(ConfigError, match=words):
            RedirectConfig.from_yaml(text)
    with pytest.raises(ConfigError, match="nested too deeply"):
        RedirectConfig.from_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="not valid JSON"):
        RedirectConfig.from_json('{"proxy_port": ' + "1" * 5000 + "}")
    latin1 = tmp_path / "c.yaml"
    latin1.write_bytes(b"proxy_port: 15001\n# caf\xe9\n")
    with pytest.raises(ConfigError) as ei:
        RedirectConfig.from_file(str(latin1))
    assert ei.value.value == str(latin1) and "not UTF-8" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        RedirectConfig.from_file("/dev/zero")  # never opened: only a regular file is read
    assert ei.value.value == "/dev/zero" and "a character device, not a regular file" in str(ei.value)
    fifo = tmp_path / "fifo.yaml"  # (opening one would wait for a writer)
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="a FIFO, not a regular file"):
        RedirectConfig.from_file(str(fifo))
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError) as ei:
        RedirectConfig.from_file(str(huge))
    assert ei.value.value == str(huge) and "larger than" in str(ei.value)
    broken = tmp_path / "c.json"
    broken.write_text('{"proxy_port": ')
    with pytest.raises(ConfigError) as ei:
        RedirectConfig.from_file(str(broken))
    assert ei.value.value == str(broken) and "not valid JSON" in str(ei.value)
    with pytest.raises(ConfigError, match="field names are strings"):
        RedirectConfig.from_dict({1: 2})


def test_istio_probe_flags_take_ascii_numbers_only() -> None:
    for argv, flag in ((["--iptables-probe-port", "١٥٠٠٢"], "--iptables-probe-port"),
                       (["--probe-timeout", "٥s"], "--probe-timeout"), (["--probe-timeout", "inf"], "--probe-timeout"),
                       (["--probe-timeout", "0s"], "--probe-timeout"), (["-p", "1_5001"], "--envoy-port")):
        p = argparse.ArgumentParser(add_help=False)
        add_arguments(p)
        with pytest.raises(ConfigError) as ei:
            options_from_args(p.parse_args(argv), env={})
        assert ei.value.field == flag
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    opts = options_from_args(p.parse_args(["--probe-timeout", "500ms", "--iptables-probe-port", "15002"]), env={})
    assert (opts.probe_timeout, opts.probe_port) == (0.5, 15002)


def test_resolv_conf_that_is_not_utf8_still_gives_its_servers(tmp_path: Any) -> None:
    p = tmp_path / "resolv.conf"
    p.write_bytes(b"# \xff\xfe\nnameserver 10.0.0.10\n")
    assert resolv_conf_servers(str(p)) == ("10.0.0.10",)


def test_normalize_ip_is_the_one_address_check_of_config_node_and_agent() -> None:
    import ipaddress

    from redirect.config import normalize_ip

    assert normalize_ip(" 10.0.0.1 ") == "10.0.0.1"
    assert normalize_ip("FD00:0::1") == "fd00::1"
    assert normalize_ip(ipaddress.ip_address("fd00::2"), 6) == "fd00::2"
    assert normalize_ip("10.0.0.1", 6) is None and normalize_ip("fd00::1", 4) is None
    assert normalize_ip("10.0.0.1/32") is None and normalize_ip(10) is None and normalize_ip("") is None
