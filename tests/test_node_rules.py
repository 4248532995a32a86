"""The node's probe rules: a plan of typed rules, rendered by the iptables backend exactly as
``iptables-save`` prints them (no root: plan and renderer only; the kernel tests in
test_ambient.py check that ``setup_node`` installs them and ``check_node`` finds them)."""

from __future__ import annotations

import pytest

from redirect.ambient import node
from redirect.backends.iptables_rules import render_rule

pytestmark = pytest.mark.noroot

_COMMENT = '-m comment --comment "redirect: kubelet probes to ambient pods come from the probe address"'


@pytest.mark.parametrize(("fam", "cfg", "source"), [
    (4, node.NodeConfig(), "169.254.7.127"),
    (6, node.NodeConfig(), "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"),
    (4, node.NodeConfig(probe_snat_ipv4=" 169.254.1.1 "), "169.254.1.1"),
    (6, node.NodeConfig(probe_snat_ipv6="FD00::0:7"), "fd00::7"),
])
def test_the_snat_rule_renders_as_iptables_save_prints_it(fam: int, cfg: node.NodeConfig, source: str) -> None:
    snat, jump = node.node_rules(fam, cfg)
    assert render_rule(node.CHAIN, snat) == (
        f"-A RDR_NODE_POSTRT -p tcp -m owner --socket-exists -m set --match-set rdr-inpod-probes-v{fam} dst"
        f" {_COMMENT} -j SNAT --to-source {source}")
    assert render_rule("POSTROUTING", jump, prefix="") == (
        '-A POSTROUTING -m comment --comment "redirect: kubelet probes" -j RDR_NODE_POSTRT')


def test_a_probe_address_of_the_wrong_family_is_refused_naming_the_field() -> None:
    from redirect.errors import ConfigError

    with pytest.raises(ConfigError, match="probe_snat_ipv4"):
        node.NodeConfig(probe_snat_ipv4="fd00::1")
    with pytest.raises(ConfigError, match="probe_snat_ipv6"):
        node.NodeConfig(probe_snat_ipv6="10.0.0.1")
