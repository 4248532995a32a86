"""RedirectConfig validation: every bad value is a ConfigError naming the field and the value."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from redirect import ConfigError, RedirectConfig
from redirect.config import field_names
from redirect.istio import config_from_istio_args, resolv_conf_servers

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
