"""End to end: containerd + ``ctr run --cni`` with bridge + host-local, then redirect-cni.

A busybox container under a containerd of the test's own (tests/ctrkit.py) gets its network from
the reference plugins chained with ours, installed by ``redirect-cni install`` into a conf dir of
the test's own. No node agent runs: the thin plugin falls back to the Python plugin (``agentDown:
inProcess``); tests/test_cni_thin.py runs the same through the agent.
"""

from __future__ import annotations

import os
import time

from redirect.cni import install as inst
from tests.ctrkit import Containerd, bridge_net, containerd, ctr_run, needs_containerd, wait_task  # noqa: F401
from tests.netkit import TcpListener

pytestmark = needs_containerd


def test_container_started_by_containerd_is_captured_and_cleaned_up(containerd: Containerd) -> None:  # noqa: F811
    with bridge_net(containerd.base, "rdrt-e2e", 244) as net:
        original = open(net.conflist, "rb").read()
        log_file = os.path.join(containerd.base, "cni.log")
        # No node agent runs here: the thin plugin execs the Python one (tests/test_cni_thin.py has the agent)
        assert inst.install(net.net_d, net.bin_d, {
            "logFile": log_file, "logLevel": "info", "agentDown": "inProcess",
            "agentSocket": os.path.join(containerd.base, "no-agent.sock")}) == net.conflist
        cid = f"rdrt-{os.urandom(3).hex()}"
        t0 = time.monotonic()
        with ctr_run(containerd, net, cid) as run:
            pid = wait_task(containerd, cid, run, ready=lambda: "ADD" in (
                open(log_file).read() if os.path.exists(log_file) else ""))
            started = time.monotonic() - t0
            with TcpListener(f"/proc/{pid}/ns/net", 15001, label="proxy") as proxy:
                containerd.ctr("task", "exec", "--exec-id", "probe", cid, "/bin/busybox", "sh", "-c",
                               f"echo from-container | /bin/busybox nc -w 2 {net.target} 8080", timeout=15)
                conns = proxy.wait_for(1, timeout=5)
            assert conns[0].line == "from-container"
            assert conns[0].orig_dst == (net.target, 8080)
            assert conns[0].peer[0].startswith(f"{net.prefix}.")
            assert len(net.leases()) == 1

            containerd.ctr("task", "kill", "-s", "KILL", cid)
            run.wait(20)
            log = open(log_file).read()
            assert f"DEL container=default-{cid}" in log  # our DEL ran
            assert not net.leases()  # lease freed
            assert cid not in containerd.ctr("container", "ls")
            print(f"ctr run --cni to a running captured container: {started * 1e3:.0f} ms")
        inst.uninstall(net.net_d, net.bin_d)
        assert open(net.conflist, "rb").read() == original
        assert not os.path.exists(os.path.join(net.bin_d, "redirect-cni"))
        assert not os.path.exists(os.path.join(net.bin_d, "redirect-cni-python"))
