"""Golden renderings: ``redirect.render(cfg, backend=B)`` for a set of configs, checked in.

Every rule change shows in review as a diff of these files. ``tests/test_golden.py``
compares them (no root needed); after an intended change, update them with

    .venv/bin/python -m tests.golden --update

and review the diff. A config the eBPF backend refuses has no ``ebpf`` file.
"""

from __future__ import annotations

import os
from typing import Any

from redirect import RedirectConfig
from redirect.errors import BackendUnavailable

DIR = os.path.dirname(os.path.abspath(__file__))
BACKENDS = ("iptables", "nftables", "ebpf")
INJECTOR: dict[str, Any] = {"inbound_ports": "*", "outbound_cidrs": "*", "inbound_exclude_ports": (15090, 15021, 15020)}

#: name -> config fields. Sidecar and ambient, covering every option of the plan.
CONFIGS: dict[str, dict[str, Any]] = {
    "sidecar-default": {},
    "sidecar-injector": INJECTOR,
    "sidecar-capture-nothing": {"inbound_ports": (), "outbound_cidrs": ()},
    "sidecar-ipv4-only": {"ipv6": False, "outbound_exclude_ports": (22,)},
    "sidecar-excludes": {
        "outbound_exclude_ports": (22, 3306), "outbound_exclude_cidrs": ("10.96.0.0/12", "fd00:96::/64"),
        "inbound_exclude_ports": (15090, 15021, 15020, 9000),
    },
    "sidecar-includes": {
        "outbound_cidrs": ("10.0.0.0/8", "fd00::/8"), "outbound_ports": (443, 8443),
        "inbound_ports": (8080, 9090, 15008, 15021), "inbound_exclude_ports": (9090,),
    },
    "sidecar-include-loopback": {"outbound_cidrs": ("127.0.0.0/8", "10.1.0.0/16"), "dns_capture": True,
                                 "capture_all_dns": True},
    "sidecar-ids": {"proxy_uids": (1337, (2000, 2999)), "proxy_gids": ((5000, 5001),),
                    "ipv4_loopback_cidr": "127.0.0.0/8"},
    "sidecar-uid-only": {"proxy_gids": (), "dns_capture": True, "dns_servers": ("10.96.0.10",)},
    "sidecar-owner-groups": {"owner_groups": (3000, (4000, 4100))},
    "sidecar-owner-groups-exclude": {"owner_groups_exclude": (3000,)},
    "sidecar-dns-all": {"dns_capture": True, "capture_all_dns": True},
    "sidecar-dns-servers": {"dns_capture": True, "dns_servers": ("10.96.0.10", "fd00:96::a")},
    "sidecar-dns-ineffective": {"dns_capture": True},
    "sidecar-dns-gid-hairpin-as-istio": {"dns_capture": True, "capture_all_dns": True,
                                         "gid_hairpin_skips_dns": False},
    "sidecar-tproxy": {"inbound_interception": "TPROXY", "inbound_exclude_ports": (15090,)},
    "sidecar-tproxy-ports": {"inbound_interception": "TPROXY", "inbound_ports": (8080, 8081),
                             "dns_capture": True, "capture_all_dns": True, "tproxy_mark": 4242,
                             "tproxy_route_table": 200},
    "sidecar-interfaces": {"exclude_interfaces": ("eth1",), "reroute_interfaces": ("vm0",),
                           "inbound_interception": "TPROXY"},
    "sidecar-reroute-cidrs": {"reroute_interfaces": ("vm0", "vm1"), "outbound_cidrs": ("10.0.0.0/8",)},
    "sidecar-drop-invalid": {"drop_invalid": True, "outbound_exclude_ports": (22,)},
    "sidecar-ports": {"proxy_port": 16001, "inbound_port": 16006, "tunnel_port": 16008, "dns_port": 16053,
                      "dns_capture": True, "capture_all_dns": True},
    "ambient-default": {"mode": "ambient"},
    "ambient-dns": {"mode": "ambient", "dns_capture": True, "capture_all_dns": True},
    "ambient-ingress-marks": {"mode": "ambient", "bypass_inbound_capture": True, "dns_capture": True, "ipv6": False,
                              "proxy_mark": 0x100, "proxy_mark_mask": 0xF00, "conn_mark": 0x200, "route_table": 150},
    "ambient-ingress-reroute": {"mode": "ambient", "bypass_inbound_capture": True, "reroute_interfaces": ("vm0",),
                                "proxy_mark": 0x100, "proxy_mark_mask": 0xF00, "conn_mark": 0x200,
                                "route_table": 150},
}


def config(name: str) -> RedirectConfig:
    return RedirectConfig(**CONFIGS[name])


def path(name: str, backend: str) -> str:
    return os.path.join(DIR, f"{name}.{backend}.golden")


def rendered(name: str, backend: str) -> str | None:
    """The rendering of config ``name`` on ``backend``, None when that backend refuses it.

    What ``redirect.render(cfg, backend=backend)`` prints, from the backend's renderer itself:
    ``redirect.render`` first probes the kernel for nftables, which needs root.
    """
    from redirect.backends.ebpf import EbpfBackend
    from redirect.backends.iptables import IptablesBackend
    from redirect.backends.nftables import NftablesBackend
    from redirect.plan.intent import intent_for

    cfg = config(name)
    impl = {"iptables": IptablesBackend(), "nftables": NftablesBackend(), "ebpf": EbpfBackend()}[backend]
    families = (4,) if cfg.ipv6 is False else (4, 6)
    try:
        return str(impl.render(intent_for(cfg), families))
    except BackendUnavailable:
        return None


def cases() -> list[tuple[str, str]]:
    return [(n, b) for n in CONFIGS for b in BACKENDS]
