"""``--run-validation``: prove with a real connection that capture works.

Like istio-iptables' validator, traffic never leaves the namespace: listen on the
proxy's inbound port, connect as the proxy's uid/gid to the pod's own
(non-loopback) address on the probe port, and expect the connection to be
captured (the proxy-to-own-VIP hairpin rule) with the probe port as its original
destination. A process that runs as the proxy (Istio's validation container:
``--run-validation --skip-rule-apply`` as uid 1337, no capabilities) connects itself;
another needs ``CAP_SETUID`` and ``CAP_SETGID`` to connect from a child as the proxy
(``cannot_validate`` says so before anything is installed).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading

from ..config import RedirectConfig
from ..kernel import netns as _netns
from ..kernel.caps import missing
from ..relay import original_dst


def _local_ipv4() -> str | None:
    from ..kernel import netlink

    for _f, _i, ip in netlink.addresses(socket.AF_INET):
        if not ipaddress.ip_address(ip).is_loopback:
            return ip
    return None


_CLIENT = (
    "import socket,sys\n"
    "s=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=float(sys.argv[3]))\n"
    "s.close()\n"
)


def _proxy_ids(cfg: RedirectConfig) -> tuple[int | None, int | None]:
    """The uid and gid the probe connects as: the first proxy uid and gid (of a range, its first)."""
    uid = cfg.proxy_uids[0] if cfg.proxy_uids else None
    gid = cfg.proxy_gids[0] if cfg.proxy_gids else None
    return (uid[0] if isinstance(uid, tuple) else uid), (gid[0] if isinstance(gid, tuple) else gid)


def _is_proxy(uid: int | None, gid: int | None) -> bool:
    """Whether this process already runs as the proxy (as Istio's validation container does)."""
    return (uid is None or os.geteuid() == uid) and (gid is None or os.getegid() == gid)


def cannot_validate(cfg: RedirectConfig) -> str | None:
    """Why this process can't connect as the proxy for the probe (None: it can): it is not the
    proxy's uid/gid and lacks the capabilities to become it in a child."""
    uid, gid = _proxy_ids(cfg)
    if _is_proxy(uid, gid):
        return None
    lacking = missing("SETUID", "SETGID")
    if not lacking:
        return None
    return (f"--run-validation connects as the proxy (uid {uid}, gid {gid}); this process runs as uid {os.geteuid()}"
            f" gid {os.getegid()} and lacks {' and '.join(lacking)} to switch. Run the validation as the proxy's"
            f" uid and gid (as Istio's validation container does: --run-validation --skip-rule-apply), or grant"
            f" {' and '.join(lacking)}")


def _connect_as_proxy(cfg: RedirectConfig, ip: str, port: int, timeout: float) -> None:
    """Connect as the proxy: from this thread when this process is the proxy, else from a child
    running as the proxy (it inherits this thread's netns)."""
    import subprocess
    import sys

    uid, gid = _proxy_ids(cfg)
    if _is_proxy(uid, gid):
        socket.create_connection((ip, port), timeout=timeout).close()
        return
    p = subprocess.run([sys.executable, "-S", "-c", _CLIENT, ip, str(port), str(timeout)],
                       user=uid, group=gid, extra_groups=[] if gid is not None else None,
                       capture_output=True, text=True, timeout=timeout + 5, check=False)
    if p.returncode != 0:
        raise OSError(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"client exit {p.returncode}")


def validate_outbound(netns: _netns.NetnsRef, cfg: RedirectConfig, probe_port: int, timeout: float) -> tuple[bool, str]:
    """(ok, message). Never raises for a failed capture; only for a missing netns."""
    result: dict[str, object] = {}

    def run() -> None:
        with _netns.enter(netns):
            ip = _local_ipv4()
            if ip is None:
                result["msg"] = "validation: no non-loopback IPv4 address in the namespace"
                return
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                srv.bind(("0.0.0.0", cfg.inbound_port))
            except OSError as e:
                result["msg"] = f"validation: cannot listen on {cfg.inbound_port}: {e.strerror}"
                srv.close()
                return
            srv.listen(4)
            srv.settimeout(timeout)
            try:
                _connect_as_proxy(cfg, ip, probe_port, timeout)
                conn, _ = srv.accept()
                dst = original_dst(conn)
                conn.close()
                if dst is None:
                    raise OSError("no original destination (not NAT'd)")
                result["ok"] = dst == (ip, probe_port)
                result["msg"] = f"validation: connection to {ip}:{probe_port} captured on {cfg.inbound_port}, " \
                                f"original destination {dst[0]}:{dst[1]}"
            except OSError as e:
                result["msg"] = f"validation failed: connection to {ip}:{probe_port} was not captured ({e})"
            finally:
                srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout * 2 + 5)
    return bool(result.get("ok")), str(result.get("msg", "validation timed out"))
