"""The pods' ``sk_lookup`` programs, loaded ahead in a pool (redirect/bpf/redirect.h, ``lookup_slots``).

An sk_lookup program can't ask for its netns cookie, so each pod's netns runs a program of its own:
a stub holding a slot number (``rdr_ebpf_pool_prog``) that reads the pod's cookie from
``lookup_slots[slot]``. Loading one costs a verifier run, so they are loaded ahead, a batch
(``BATCH``) at a time, into ``lookup_pool`` (slot -> program), and their slots queued in
``lookup_free`` (a queue map: a claim pops one in constant time):

- the host load fills the first batch (``fill``);
- a pod's setup claims a slot (``rdr_ebpf_pod_write``: ``BPF_NOEXIST`` in ``lookup_slots``, one
  popped from the queue first; a popped slot claimed already is dropped) and links its program;
  the claim records the pod's netns cookie and inode; the process keeps up to ``RDR_PROG_CACHE``
  of the programs it loaded or linked open (``struct rdr_host_maps``'s ``prog_fds``), so a claim of such a slot
  links it without looking it up;
- when the setup found the queue empty, it claims an unclaimed slot, loads its program on demand,
  and loads the next batch before it returns (``refill``): a setup never fails for want of a slot;
- teardown releases the slot once the pod's link is gone (``release``), and so does the garbage
  collection for a pod whose netns went, for a claim whose setup was killed before its link was
  pinned (``reclaim``: no setup holds that netns's lock) and for a slot that is neither claimed
  nor queued (a teardown killed in between, a full queue).

The programs live as long as ``lookup_pool`` (pinned with the host maps): ``unload_host`` removes
them with it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable
from typing import Any

from ....errors import SetupError
from ....kernel import locks
from ..abi import POOL_MAX, POOL_SLOT, U32
from .syscalls import NATIVE, Map, check, pinned_link_info

log = logging.getLogger("redirect.ebpf")

#: Programs loaded at a time (at the host load, and when a setup took the last free slot).
BATCH = 64


def push(free: int, slot: int) -> None:
    """Queue ``slot`` free in ``lookup_free`` (fd ``free``); a full queue is left as it is (a slot
    neither claimed nor queued is found by a setup's scan, and queued again by the garbage
    collection)."""
    rc = NATIVE.lib.rdr_bpf_map_push(free, U32.pack(slot))
    if rc != -errno.E2BIG:
        check(rc, "push lookup_free")


def drain(free: int) -> list[int]:
    """Empty the ``lookup_free`` queue (fd ``free``); the slots it held, oldest first."""
    lib, out = NATIVE.lib, NATIVE.ffi.new("uint32_t *")
    got: list[int] = []
    for _ in range(2 * POOL_MAX):  # (bounded: setups push back meanwhile)
        rc = lib.rdr_bpf_map_pop(free, out)
        if rc == -errno.ENOENT:
            break
        check(rc, "pop lookup_free")
        got.append(int(out[0]))
    return got


def kept_programs() -> tuple[Any, Any]:
    """An empty cache of pool programs kept open (``struct rdr_host_maps``'s ``prog_fds``, ``n_prog_fds``)."""
    return NATIVE.ffi.new("int[]", [-1] * POOL_MAX), NATIVE.ffi.new("int *")


def close_kept(fds: Any, n_fds: Any) -> None:
    """Close the programs of a cache from ``kept_programs`` and empty it."""
    for i in range(POOL_MAX):
        if fds[i] >= 0:
            with contextlib.suppress(OSError):
                os.close(fds[i])
            fds[i] = -1
    n_fds[0] = 0


def fill(maps: Any, start: int, n: int = BATCH) -> int:
    """Load ``n`` programs for the slots from ``start`` on that have none in ``lookup_pool``, on the
    maps of ``maps`` (a ``struct rdr_host_maps``), and queue them free; each is kept open in its
    cache (``prog_fds``) while that has room, so this process's claims of those slots need no
    look-up. The slot after the last one looked at (where the next batch starts)."""
    lib, ffi = NATIVE.lib, NATIVE.ffi
    out = ffi.new("uint32_t *")
    s, loaded = start, 0
    while loaded < n and s < POOL_MAX:
        key = U32.pack(s)
        if lib.rdr_bpf_map_lookup(maps.pool, key, out) != 0:
            pfd = check(lib.rdr_ebpf_pool_prog(maps.slots, maps.lookup_netns, maps.lookup_prog, s),
                        "BPF_PROG_LOAD sk_lookup")
            try:
                check(lib.rdr_bpf_map_update(maps.pool, key, U32.pack(pfd), 0), "update lookup_pool")
            finally:
                if not lib.rdr_prog_cache_put(maps.prog_fds, maps.n_prog_fds, s, pfd):
                    os.close(pfd)
            push(maps.free, s)
            loaded += 1
        s += 1
    return s


def refill(maps: Any, hint: Any, n: int = BATCH) -> None:
    """The next batch of the pool of ``maps`` (``fill`` from ``hint[0]``, where this process's last
    one ended), after a setup found no slot queued free. A failure is logged, not raised: that setup
    is done, and the next ones load their programs on demand (and try a batch again)."""
    if min(maps.slots, maps.lookup_netns, maps.lookup_prog, maps.pool, maps.free) < 0:
        return  # (a handle on what is still attached, pins gone: setups load on demand)
    try:
        hint[0] = fill(maps, int(hint[0]), n)
    except OSError as e:
        log.warning("ebpf: loading the next %d sk_lookup programs of the pool failed (%s); setups load theirs"
                    " on demand meanwhile", n, e)


def prog_slot(prog_id: int) -> int | None:
    """The slot the pool program ``prog_id`` holds; None if it is not one of them."""
    out = NATIVE.ffi.new("uint32_t *")
    return int(out[0]) if NATIVE.lib.rdr_ebpf_pool_prog_slot(prog_id, out) == 0 else None


def prog_cookie(slots: Map | None, prog_id: int) -> int | None:
    """The netns cookie whose pod the pool program ``prog_id`` serves (its slot's claim in
    ``lookup_slots``); None if it is not a pool program or its slot is not claimed."""
    slot = prog_slot(prog_id)
    if slot is None or slots is None:
        return None
    v = slots.lookup(U32.pack(slot))
    return None if v is None else int(POOL_SLOT.unpack(v)[0])


def release(slots: Map | None, free: Map | None, cookie: int, prog_id: int | None) -> bool:
    """Give back the slot of the pool program ``prog_id`` if it is claimed for ``cookie``: called
    once the pod's link is gone (no netns runs the program any more). True if one was."""
    slot = None if prog_id is None else prog_slot(prog_id)
    if slot is None or slots is None:
        return False
    key = U32.pack(slot)
    v = slots.lookup(key)
    if v is None or POOL_SLOT.unpack(v)[0] != cookie:
        return False
    slots.delete(key)
    if free is not None:
        push(free.fd, slot)
    return True


def reclaim(slots: Map | None, free: Map | None, pool: Map | None, hint: int,
            link_of: Callable[[int], str]) -> list[int]:
    """The garbage collection's part: release the claims that no pod's link (pinned at
    ``link_of(cookie)``) uses and no setup is making (its netns lock is free: a setup holds it from
    its claim until its link is pinned), and queue free again the loaded slots that are neither
    claimed nor queued (the queue is emptied and made again: each free slot once). ``hint``: where
    this process's next batch starts. The slots released."""
    if slots is None or free is None or pool is None:
        return []
    out: list[int] = []

    def in_use(slot: int, cookie: int) -> bool:
        info = pinned_link_info(link_of(cookie))
        return info is not None and prog_slot(info["prog_id"]) == slot

    for key in list(slots.keys(POOL_MAX)):
        v = slots.lookup(key)
        if v is None:
            continue
        cookie, ino = POOL_SLOT.unpack(v)
        slot = U32.unpack(key)[0]
        if in_use(slot, cookie):
            continue
        try:
            with locks.netns_lock(ino, wait_s=0):
                v = slots.lookup(key)  # again, now that no setup of that netns can run
                if v is None or POOL_SLOT.unpack(v) != (cookie, ino) or in_use(slot, cookie):
                    continue
                slots.delete(key)
                push(free.fd, slot)
                out.append(slot)
                log.info("ebpf: released pool slot %d of netns cookie %d: no link uses it", slot, cookie)
        except SetupError:
            continue  # a setup of that netns is under way: its claim is its own
    queued = set(drain(free.fd))
    claimed = {U32.unpack(k)[0] for k in slots.keys(POOL_MAX)}
    ids = NATIVE.ffi.new("uint32_t *")
    lib = NATIVE.lib
    # Slots are loaded from 0 up, a batch at a time (on demand: from this process's hint on).
    top = min(POOL_MAX, max((*claimed, *queued, hint)) + BATCH + 1)
    for slot in range(top):
        if slot in claimed:
            continue
        key = U32.pack(slot)
        if lib.rdr_bpf_map_lookup(pool.fd, key, ids) != 0:
            continue
        with contextlib.suppress(OSError):
            push(free.fd, slot)
            if slot not in queued:
                out.append(slot)
    return out


__all__ = ["BATCH", "push", "drain", "kept_programs", "close_kept", "fill", "refill", "prog_slot", "prog_cookie",
           "release", "reclaim"]
