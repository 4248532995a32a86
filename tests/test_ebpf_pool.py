"""The pool of the pods' sk_lookup programs (redirect/backends/ebpf/host/pool.py): loaded ahead, a slot
claimed per pod and given back at teardown, grown a batch at a time, loaded on demand when empty,
reclaimed by the garbage collection after a killed setup, and gone with the host programs."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time

from redirect import api
from redirect.backends import ebpf
from redirect.backends.ebpf.abi import POOL_MAX, POOL_SLOT
from redirect.backends.ebpf.host import pod_link, pool, syscalls
from redirect.config import RedirectConfig
from redirect.kernel import locks
from redirect.kernel import netns as rnetns
from tests.netkit import Pod, TcpListener, landing

U32 = struct.Struct("=I")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(root: str) -> tuple[dict[int, tuple[int, int]], set[int], dict[int, int]]:
    """(slot -> (netns cookie, inode) claimed, the slots queued free, slot -> program id loaded).
    The queue is read by emptying it and queueing the same again."""
    h = ebpf.host(root, load=False)
    assert h is not None
    slots, free, progs = h.maps["lookup_slots"], h.maps["lookup_free"], h.maps["lookup_pool"]
    claimed = {U32.unpack(k)[0]: POOL_SLOT.unpack(slots.lookup(k) or bytes(16)) for k in slots.keys()}
    loaded = {}
    for s in range(POOL_MAX):
        v = progs.lookup(U32.pack(s))
        if v is not None:
            loaded[s] = U32.unpack(v)[0]
    queued = pool.drain(free.fd)
    for s in queued:
        pool.push(free.fd, s)
    return claimed, set(queued), loaded


def _cookie(pod: Pod) -> int:
    with rnetns.enter(pod.name):
        return ebpf.current_netns_cookie()


def _link_prog(root: str, cookie: int) -> int:
    fd = syscalls.obj_get(pod_link(root, cookie))
    try:
        return syscalls.link_info(fd)["prog_id"]
    finally:
        os.close(fd)


def _inbound_lands_on_proxy(pod: Pod) -> None:
    with TcpListener(pod.name, 15006, label="in") as proxy:
        assert landing(pod.peer_name, pod.pod_ip4, 8080, proxy).listener is proxy


def test_a_pod_runs_a_program_of_the_pool_whose_slot_is_given_back_and_reused(make_pod, ebpf_root: str) -> None:
    first = make_pod()
    api.setup(first.name, RedirectConfig(), backend="ebpf")  # (the host load: the first batch)
    try:
        _reused(make_pod, ebpf_root)
    finally:
        api.teardown(first.name, backend="ebpf")


def _reused(make_pod, ebpf_root: str) -> None:
    claimed0, free0, loaded0 = _state(ebpf_root)
    assert len(loaded0) >= pool.BATCH and free0 == set(loaded0) - set(claimed0) and len(claimed0) == 1
    for _ in range(3):
        p = make_pod()
        cookie = _cookie(p)
        assert api.setup(p.name, RedirectConfig(), backend="ebpf").detail["path"] == "fresh"
        claimed, free, loaded = _state(ebpf_root)
        mine = [s for s, (c, _ino) in claimed.items() if c == cookie]
        assert len(mine) == 1 and mine[0] not in free, (mine, free)
        assert claimed[mine[0]][1] == rnetns.netns_inode(p.name)
        assert _link_prog(ebpf_root, cookie) == loaded[mine[0]], "its link runs the slot's program, loaded ahead"
        assert loaded == loaded0, "no program loaded for it"
        h = ebpf.host(ebpf_root, load=False)
        assert h is not None and h.prog_fds[mine[0]] >= 0, "kept open by this process for the slot's next claim"
        _inbound_lands_on_proxy(p)
        assert api.check(p.name, RedirectConfig(), backend="ebpf").ok
        assert api.teardown(p.name, backend="ebpf")
        claimed, free, loaded = _state(ebpf_root)
        assert mine[0] not in claimed and mine[0] in free, "teardown gives the slot back"
        assert (claimed, free) == (claimed0, free0)
    h = ebpf.host(ebpf_root, load=False)
    assert h is not None
    m = h.maps
    assert pool.reclaim(m["lookup_slots"], m["lookup_free"], m["lookup_pool"], int(h.pool_hint[0]),
                        h.store.link_path) == []  # nothing for the garbage collection


def test_a_setup_that_finds_no_slot_queued_free_loads_one_on_demand_and_the_next_batch(
        make_pod, ebpf_root: str) -> None:
    h = ebpf.host(ebpf_root)
    assert h is not None
    # Other processes took every free slot (as far as this process can tell): the next setup
    # claims an unclaimed slot, loads its program if none is loaded, and the batch after follows.
    claimed0, free0, loaded0 = _state(ebpf_root)
    assert set(pool.drain(h.maps["lookup_free"].fd)) == free0
    gone = min(set(loaded0) - set(claimed0))
    h.maps["lookup_pool"].delete(U32.pack(gone))  # and one program is not loaded any more
    h.forget_programs()  # (nor kept open by this process)
    h.pool_hint[0] = gone
    p = make_pod()
    cookie = _cookie(p)
    try:
        assert api.setup(p.name, RedirectConfig(), backend="ebpf").changed
        claimed, free, loaded = _state(ebpf_root)
        assert claimed[gone][0] == cookie, "claimed the unclaimed slot, its program loaded on demand"
        assert _link_prog(ebpf_root, cookie) == loaded[gone] and loaded[gone] != loaded0[gone]
        assert len(free) == pool.BATCH and not free & set(loaded0), "a new batch, loaded ahead"
        assert len(loaded) == len(loaded0) + pool.BATCH
        _inbound_lands_on_proxy(p)
        # The slots listed free by nobody are found again by the garbage collection.
        assert ebpf.collect_garbage(ebpf_root) == []
        claimed, free, _ = _state(ebpf_root)
        assert free == set(loaded) - set(claimed)
    finally:
        api.teardown(p.name, backend="ebpf")


KILLED_SETUP = """
import os, sys
from redirect import api
api.setup(sys.argv[1], backend="ebpf")
"""


def test_a_setup_killed_after_its_claim_leaves_a_slot_the_garbage_collection_gives_back(
        pod: Pod, ebpf_root: str) -> None:
    ebpf.host(ebpf_root)
    cookie = _cookie(pod)
    env = {**os.environ, "REDIRECT_FAULT": "ebpf.after_claim:kill", "REDIRECT_BPF_ROOT": ebpf_root}
    r = subprocess.run([sys.executable, "-c", KILLED_SETUP, pod.name], env=env, cwd=REPO, capture_output=True,
                       timeout=60)
    assert r.returncode == -9, r.stderr.decode()
    claimed, free, _ = _state(ebpf_root)
    mine = [s for s, (c, _ino) in claimed.items() if c == cookie]
    assert len(mine) == 1 and not os.path.exists(pod_link(ebpf_root, cookie))
    # While a setup of that netns holds its lock (it may be the one claiming), the claim stays.
    held, stop = threading.Event(), threading.Event()

    def hold() -> None:
        with locks.netns_lock(rnetns.netns_inode(pod.name)):
            held.set()
            stop.wait(10)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    try:
        assert held.wait(10)
        ebpf.collect_garbage(ebpf_root)
        assert mine[0] in _state(ebpf_root)[0]
    finally:
        stop.set()
        t.join(10)
    ebpf.collect_garbage(ebpf_root)
    claimed, free, _ = _state(ebpf_root)
    assert mine[0] not in claimed and mine[0] in free
    try:
        assert api.setup(pod.name, RedirectConfig(), backend="ebpf").changed
        assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok
        _inbound_lands_on_proxy(pod)
    finally:
        api.teardown(pod.name, backend="ebpf")


def test_the_pools_programs_go_with_the_host_programs(pod: Pod, monkeypatch) -> None:
    root = f"/sys/fs/bpf/rdrt-ebpf-pool-unload-{os.getpid()}"
    monkeypatch.setenv("REDIRECT_BPF_ROOT", root)
    try:
        api.setup(pod.name, RedirectConfig(), backend="ebpf")
        cookie = _cookie(pod)
        progs = {*_state(root)[2].values(), _link_prog(root, cookie)}
        assert len(progs) >= pool.BATCH
        api.teardown(pod.name, backend="ebpf")
        assert ebpf.unload_host(root)
    finally:
        ebpf.force_unload_host(root)
    assert not os.path.exists(root)
    lib = syscalls.NATIVE.lib
    deadline = time.monotonic() + 10
    left = progs
    while left and time.monotonic() < deadline:
        fds = {p: lib.rdr_bpf_prog_get_fd_by_id(p) for p in left}
        for fd in fds.values():
            if fd >= 0:
                os.close(fd)
        left = {p for p, fd in fds.items() if fd >= 0}
        time.sleep(0.05)
    assert not left, f"{len(left)} of the pool's programs are still loaded"


def test_a_queued_slot_that_is_claimed_already_is_dropped_and_the_next_one_claimed(make_pod, ebpf_root: str) -> None:
    first = make_pod()
    api.setup(first.name, RedirectConfig(), backend="ebpf")
    try:
        h = ebpf.host(ebpf_root, load=False)
        assert h is not None
        claimed0, _, _ = _state(ebpf_root)
        (taken,) = claimed0
        free = h.maps["lookup_free"].fd
        rest = pool.drain(free)
        for s in (taken, rest[0], *rest):  # the first pod's slot, then a free one listed twice
            pool.push(free, s)
        p = make_pod()
        cookie = _cookie(p)
        assert api.setup(p.name, RedirectConfig(), backend="ebpf").detail["path"] == "fresh"
        claimed, queued, _ = _state(ebpf_root)
        assert claimed[taken] == claimed0[taken], "the first pod keeps its slot"
        assert claimed[rest[0]][0] == cookie and taken not in queued
        _inbound_lands_on_proxy(p)
        _inbound_lands_on_proxy(first)
        assert api.teardown(p.name, backend="ebpf")
        # Its slot is queued again, and was still queued once: the garbage collection leaves
        # each free slot queued once.
        queued_list = pool.drain(free)
        for s in queued_list:
            pool.push(free, s)
        assert queued_list.count(rest[0]) == 2
        assert ebpf.collect_garbage(ebpf_root) == []
        queued_list = pool.drain(free)
        for s in queued_list:
            pool.push(free, s)
        assert sorted(queued_list) == sorted(set(queued_list)) and rest[0] in queued_list and taken not in queued_list
    finally:
        api.teardown(first.name, backend="ebpf")
