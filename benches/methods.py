"""The ways a pod gets its capture, each timed over fresh namespaces.

A ``Method`` has ``setup(ns)`` and ``teardown(ns)`` (both timed) and ``verify(ns)`` (not timed,
run once, so a method that silently does nothing can't post a great number). Kinds:

- ``api``: ``redirect.setup`` / ``redirect.teardown`` in this process;
- ``cli``: ``redirect init`` with istio-iptables flags (process start included); for what init
  can't express (a backend without an istio-iptables flag, ambient mode) ``redirect setup``;
- ``cni``: the CNI plugin's ADD and DEL (``redirect-cni``), when it is installed; the thin
  plugin's (``cni-thin/...``) are built in ``cnithin.py``;
- ``reference``: Istio's per-pod sequences, sidecar and ambient (``reference.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redirect
from redirect.kernel import netns as rnetns

from . import reference
from .reference import KEYS as REFERENCE_KEYS

VENV_BIN = os.path.dirname(sys.executable)
ISTIO_DEFAULT_FLAGS = ["-p", "15001", "-z", "15006", "-u", "1337", "-g", "1337", "-m", "REDIRECT",
                       "-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020"]
#: Backends ``redirect init`` selects through an istio-iptables flag.
INIT_BACKEND_FLAGS = {"iptables": [], "iptables-legacy": ["--force-iptables-binary", "iptables-legacy"],
                      "iptables-nft": ["--force-iptables-binary", "iptables-nft"],
                      "nftables": ["--native-nftables"]}


class Unavailable(Exception):
    """This method can't run here; the message says why (printed, recorded, not fatal)."""


@dataclass
class Method:
    key: str          # e.g. "api/iptables/sidecar"
    kind: str         # api | cli | cni | reference
    backend: str
    mode: str
    setup: Callable[[str], None]
    teardown: Callable[[str], None]
    verify: Callable[[str], None]
    note: str = ""
    #: True when deleting the namespace removes everything (netfilter rules live in the netns):
    #: untimed bulk cleanup may then skip ``teardown``. Never for state held outside the netns (BPF maps).
    cleanup_by_delete: bool = False
    #: Ports with a listener held open in each fresh namespace before setup (not timed); none for
    #: the per-pod methods (see ``NO_LISTENER``).
    listen: tuple[int, ...] = ()
    #: Run in each fresh namespace before setup, not timed (what the pod has besides lo).
    prepare: Callable[[str], None] | None = None
    #: After a timed setup, where its time went (step name -> microseconds), if the method can tell
    #: (the eBPF backend's fresh-pod call: ``ebpf.last_steps``); None when that setup can't.
    steps: Callable[[], dict[str, float] | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def config_for(mode: str) -> redirect.RedirectConfig:
    return redirect.RedirectConfig(mode=mode) if mode != "sidecar" else redirect.RedirectConfig()  # type: ignore[arg-type]


def listen_for(backend: str, mode: str) -> tuple[int, ...]:
    """Ports the data path holds a listener on in the pod before setup: the eBPF backend's proxy
    inbound listener (it is registered when it listens, before or after setup alike)."""
    return (config_for(mode).inbound_port,) if backend == "ebpf" else ()


#: Per-pod cost runs setup with no proxy listening yet, as a CNI ADD or an init container does
#: (the proxy starts after them). The eBPF backend registers the listener when it appears.
NO_LISTENER: tuple[int, ...] = ()


def _verify_api(backend: str, mode: str) -> Callable[[str], None]:
    def verify(ns: str) -> None:
        res = redirect.check(ns, config_for(mode), backend=backend)
        if not res.ok:
            raise RuntimeError(f"check after setup failed: {list(res.differences)[:3]}")
    return verify


def api_method(backend: str, mode: str) -> Method:
    cfg = config_for(mode)
    last: list[Any] = [None]

    def setup(ns: str) -> None:
        last[0] = redirect.setup(ns, cfg, backend=backend)

    def teardown(ns: str) -> None:
        redirect.teardown(ns, backend=backend)

    def steps() -> dict[str, float] | None:
        """The last setup's steps, if it took the fresh-pod call."""
        from redirect.backends import ebpf

        res, last[0] = last[0], None
        return ebpf.last_steps() if res is not None and res.detail.get("path") == "fresh" else None

    return Method(f"api/{backend}/{mode}", "api", backend, mode, setup, teardown, _verify_api(backend, mode),
                  listen=NO_LISTENER, steps=steps if backend == "ebpf" else None)


def _forwarding_pod(ns: str) -> None:
    """``fwd0`` (a veth kept in the namespace) up, and IPv4 forwarding on: a pod that forwards, as
    every pod of a Kubernetes node does (its netns takes the node's ``ip_forward``)."""
    from redirect.kernel import netlink

    with rnetns.enter(ns):
        netlink.add_veth("fwd0", "fwd0-peer")
        netlink.set_up(netlink.link_index("fwd0"))
        with open("/proc/sys/net/ipv4/ip_forward", "w", encoding="ascii") as f:
            f.write("1\n")


def forwarding_method(backend: str) -> Method:
    """``api_method(backend, "sidecar")`` in pods that forward (the eBPF backend then puts its tc
    filters on the interface: ``api/<backend>/sidecar-forwarding``)."""
    m = api_method(backend, "sidecar")
    verify = m.verify

    def verify_filters(ns: str) -> None:
        verify(ns)
        out = subprocess.run(["tc", "-n", ns, "filter", "show", "dev", "fwd0", "ingress"], capture_output=True,
                             text=True, timeout=30).stdout
        if backend == "ebpf" and "rdr_tc_ingress" not in out:
            raise RuntimeError("no tc filter of ours on the interface of a pod that forwards")

    m.key, m.note, m.prepare, m.verify = (f"api/{backend}/sidecar-forwarding", "a pod that forwards (an interface,"
                                          " ip_forward on)", _forwarding_pod, verify_filters)
    return m


def _redirect_exe() -> str:
    exe = os.path.join(VENV_BIN, "redirect")
    if not os.access(exe, os.X_OK):
        exe = shutil.which("redirect") or ""
    if not exe:
        raise Unavailable("the `redirect` command is not installed (run the bootstrap)")
    return exe


def _has_init(exe: str) -> bool:
    r = subprocess.run([exe, "init", "--help"], capture_output=True, timeout=30)
    return r.returncode == 0


def _check_run(argv: list[str], env: dict[str, str] | None = None, data: bytes | None = None) -> bytes:
    r = subprocess.run(argv, capture_output=True, timeout=60, env=env, input=data)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()
        raise RuntimeError(f"{os.path.basename(argv[0])} {argv[1] if len(argv) > 1 else ''}: exit {r.returncode}: "
                           f"{msg[-1] if msg else ''}")
    return r.stdout


def cli_method(backend: str, mode: str) -> Method:
    exe = _redirect_exe()
    use_init = mode == "sidecar" and backend in INIT_BACKEND_FLAGS and _has_init(exe)
    if use_init:
        def setup(ns: str) -> None:
            _check_run([exe, "init", *ISTIO_DEFAULT_FLAGS, *INIT_BACKEND_FLAGS[backend],
                        "--network-namespace", rnetns.path_of(ns) or ns])
        how = "redirect init (istio-iptables flags)"
    else:
        mode_args = [] if mode == "sidecar" else ["--mode", mode]

        def setup(ns: str) -> None:
            _check_run([exe, "setup", ns, "--backend", backend, *mode_args])
        how = "redirect setup (redirect init has no flag for this backend or mode)"

    def teardown(ns: str) -> None:
        _check_run([exe, "teardown", ns, "--backend", backend])

    return Method(f"cli/{backend}/{mode}", "cli", backend, mode, setup, teardown, _verify_api(backend, mode),
                  note=how, listen=NO_LISTENER)


def _cni_exe() -> str:
    for cand in (os.path.join(VENV_BIN, "redirect-cni"), shutil.which("redirect-cni") or "",
                 "/opt/cni/bin/redirect-cni"):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise Unavailable("no `redirect-cni` plugin installed yet (venv bin, PATH, /opt/cni/bin)")


def cni_conf(backend: str, mode: str, nspath: str) -> dict[str, Any]:
    """A chained-plugin network config; REDIRECT_BENCH_CNI_CONF (a JSON file) overrides it."""
    path = os.environ.get("REDIRECT_BENCH_CNI_CONF")
    if path:
        with open(path) as f:
            conf: dict[str, Any] = json.load(f)
    else:
        conf = {"cniVersion": "1.0.0", "name": "rdrt-bench", "type": "redirect-cni",
                "backend": backend, "mode": mode}
    conf.setdefault("prevResult", {"cniVersion": conf.get("cniVersion", "1.0.0"),
                                   "interfaces": [{"name": "eth0", "sandbox": nspath}], "ips": []})
    return conf


def cni_method(backend: str, mode: str) -> Method:
    exe = _cni_exe()

    def call(command: str, ns: str) -> None:
        nspath = rnetns.path_of(ns) or ns
        env = dict(os.environ, CNI_COMMAND=command, CNI_CONTAINERID=os.path.basename(nspath), CNI_NETNS=nspath,
                   CNI_IFNAME="eth0", CNI_PATH=os.path.dirname(exe), CNI_ARGS="")
        _check_run([exe], env=env, data=json.dumps(cni_conf(backend, mode, nspath)).encode())

    return Method(f"cni/{backend}/{mode}", "cni", backend, mode, lambda ns: call("ADD", ns),
                  lambda ns: call("DEL", ns), _verify_api(backend, mode), note=f"{exe} ADD/DEL",
                  listen=NO_LISTENER)


#: Each of Istio's per-pod sequences (``reference.py``): its setup, what it execs, and how many rules
#: it leaves in ``iptables-nft-save``'s dump.
REFERENCES: dict[str, tuple[Callable[[], None], str, int]] = {
    "sidecar": (reference.setup, "istio-iptables: variant detection (16 execs), saves, restore --noflush x2, saves"
                " again", reference.RULE_COUNT),
    "core": (reference.setup_core, "the same without the detection: saves, restore --noflush x2, saves again",
             reference.RULE_COUNT),
    "ambient": (reference.setup_ambient, "istio-cni node agent: lo, 2 routes and 2 rules (netlink), saves, restore"
                " --noflush x2 (mangle, nat)", reference.AMBIENT_RULE_COUNT),
}


def reference_method(kind: str = "sidecar") -> Method:
    """Istio's per-pod sequence ``kind`` (``REFERENCES``): ``sidecar`` (istio-iptables, its variant
    detection included), ``core`` (the same without the detection) or ``ambient`` (istio-cni's node
    agent). The sidecar ones tear down as ``--cleanup-only`` does; Istio leaves a deleted ambient
    pod's netns alone, so the ambient one tears down the same way, for a figure to compare."""
    do, note, rules = REFERENCES[kind]

    def setup(ns: str) -> None:
        with rnetns.enter(ns):
            do()

    def teardown(ns: str) -> None:
        with rnetns.enter(ns):
            reference.teardown()

    def verify(ns: str) -> None:
        r = subprocess.run(["ip", "netns", "exec", ns, "iptables-nft-save"], capture_output=True, timeout=30)
        if r.stdout.count(b"\n-A ") < rules:
            raise RuntimeError("reference rules not installed")

    return Method(REFERENCE_KEYS[kind], "reference", "reference", "ambient" if kind == "ambient" else "sidecar",
                  setup, teardown, verify, note=note, cleanup_by_delete=True)
