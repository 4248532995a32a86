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
  of the programs it loaded or linked open (``HostPrograms.prog_fds``), so a claim of such a slot
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
from typing import TYPE_CHECKING, Any

from ...errors import SetupError
from .abi import U32, const, layout
from .syscalls import _check, _native, _pinned_link_info

if TYPE_CHECKING:
    from .host import HostPrograms

log = logging.getLogger("redirect.ebpf")

POOL_SLOT = layout("pool_slot").struct
POOL_MAX = const("RDR_POOL_MAX")
#: Programs loaded at a time (at the host load, and when a setup took the last free slot).
BATCH = 64


def push(free: int, slot: int) -> None:
    """Queue ``slot`` free in ``lookup_free`` (fd ``free``); a full queue is left as it is (a slot
    neither claimed nor queued is found by a setup's scan, and queued again by the garbage
    collection)."""
    rc = _native().lib.rdr_bpf_map_push(free, U32.pack(slot))
    if rc != -errno.E2BIG:
        _check(rc, "push lookup_free")


def drain(free: int) -> list[int]:
    """Empty the ``lookup_free`` queue (fd ``free``); the slots it held, oldest first."""
    lib, out = _native().lib, _native().ffi.new("uint32_t *")
    got: list[int] = []
    for _ in range(2 * POOL_MAX):  # (bounded: setups push back meanwhile)
        rc = lib.rdr_bpf_map_pop(free, out)
        if rc == -errno.ENOENT:
            break
        _check(rc, "pop lookup_free")
        got.append(int(out[0]))
    return got


def kept_programs() -> tuple[Any, Any]:
    """An empty cache of pool programs kept open (``HostPrograms.prog_fds``, ``n_prog_fds``)."""
    return _native().ffi.new("int[]", [-1] * POOL_MAX), _native().ffi.new("int *")


def close_kept(fds: Any, n_fds: Any) -> None:
    """Close the programs of a cache from ``kept_programs`` and empty it."""
    for i in range(POOL_MAX):
        if fds[i] >= 0:
            with contextlib.suppress(OSError):
                os.close(fds[i])
            fds[i] = -1
    n_fds[0] = 0


def fill(slots: int, netns: int, progs: int, pool: int, free: int, start: int, n: int = BATCH,
         keep: tuple[Any, Any] | None = None) -> int:
    """Load ``n`` programs for the slots from ``start`` on that have none in ``pool`` (fds of the
    maps ``lookup_slots``, ``lookup_netns``, ``lookup_prog``, ``lookup_pool``, ``lookup_free``) and
    queue them free; each is kept open in ``keep`` (a host handle's ``prog_fds``, ``n_prog_fds``)
    while it has room, so this process's claims of those slots need no look-up. The slot after the
    last one looked at (where the next batch starts)."""
    lib, ffi = _native().lib, _native().ffi
    out = ffi.new("uint32_t *")
    fds, n_fds = keep if keep is not None else (ffi.NULL, ffi.NULL)
    s, loaded = start, 0
    while loaded < n and s < POOL_MAX:
        key = U32.pack(s)
        if lib.rdr_bpf_map_lookup(pool, key, out) != 0:
            pfd = _check(lib.rdr_ebpf_pool_prog(slots, netns, progs, s), "BPF_PROG_LOAD sk_lookup")
            try:
                _check(lib.rdr_bpf_map_update(pool, key, U32.pack(pfd), 0), "update lookup_pool")
            finally:
                if not lib.rdr_prog_cache_put(fds, n_fds, s, pfd):
                    os.close(pfd)
            push(free, s)
            loaded += 1
        s += 1
    return s


def refill(h: HostPrograms, n: int = BATCH) -> None:
    """The next batch of ``h``'s pool (``fill`` from where this process's last one ended, kept open
    in ``h``'s cache), after a setup found no slot queued free. A failure is logged, not raised:
    that setup is done, and the next ones load their programs on demand (and try a batch again)."""
    m = h.maps
    if not all(k in m for k in ("lookup_slots", "lookup_netns", "lookup_prog", "lookup_pool", "lookup_free")):
        return  # (a handle on what is still attached, pins gone: setups load on demand)
    t = h.pool_hint
    try:
        t[0] = fill(m["lookup_slots"].fd, m["lookup_netns"].fd, m["lookup_prog"].fd, m["lookup_pool"].fd,
                    m["lookup_free"].fd, int(t[0]), n, (h.prog_fds, h.n_prog_fds))
    except OSError as e:
        log.warning("ebpf: loading the next %d sk_lookup programs of the pool failed (%s); setups load theirs"
                    " on demand meanwhile", n, e)


def prog_slot(prog_id: int) -> int | None:
    """The slot the pool program ``prog_id`` holds; None if it is not one of them."""
    out = _native().ffi.new("uint32_t *")
    return int(out[0]) if _native().lib.rdr_ebpf_pool_prog_slot(prog_id, out) == 0 else None


def prog_cookie(h: HostPrograms, prog_id: int) -> int | None:
    """The netns cookie whose pod the pool program ``prog_id`` serves (its slot's claim); None if it
    is not a pool program or its slot is not claimed."""
    slot = prog_slot(prog_id)
    if slot is None or "lookup_slots" not in h.maps:
        return None
    v = h.maps["lookup_slots"].lookup(U32.pack(slot))
    return None if v is None else int(POOL_SLOT.unpack(v)[0])


def link_cookie(h: HostPrograms, path: str) -> int | None:
    """``prog_cookie`` of the link pinned at ``path`` (None: none, or not ours)."""
    info = _pinned_link_info(path)
    return None if info is None else prog_cookie(h, info["prog_id"])


def release(h: HostPrograms, cookie: int, prog_id: int | None) -> bool:
    """Give back the slot of the pool program ``prog_id`` if it is claimed for ``cookie``: called
    once the pod's link is gone (no netns runs the program any more). True if one was."""
    slot = None if prog_id is None else prog_slot(prog_id)
    slots = h.maps.get("lookup_slots")
    if slot is None or slots is None:
        return False
    key = U32.pack(slot)
    v = slots.lookup(key)
    if v is None or POOL_SLOT.unpack(v)[0] != cookie:
        return False
    slots.delete(key)
    free = h.maps.get("lookup_free")
    if free is not None:
        push(free.fd, slot)
    return True


def reclaim(h: HostPrograms, link_of: Callable[[int], str]) -> list[int]:
    """The garbage collection's part: release the claims that no pod's link (pinned at
    ``link_of(cookie)``) uses and no setup is making (its netns lock is free: a setup holds it from
    its claim until its link is pinned), and queue free again the loaded slots that are neither
    claimed nor queued (the queue is emptied and made again: each free slot once). The slots
    released."""
    from ...kernel import locks

    slots, free, pool = h.maps.get("lookup_slots"), h.maps.get("lookup_free"), h.maps.get("lookup_pool")
    if slots is None or free is None or pool is None:
        return []
    out: list[int] = []

    def in_use(slot: int, cookie: int) -> bool:
        info = _pinned_link_info(link_of(cookie))
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
    ids = _native().ffi.new("uint32_t *")
    lib = _native().lib
    # Slots are loaded from 0 up, a batch at a time (on demand: from this process's hint on).
    top = min(POOL_MAX, max((*claimed, *queued, int(h.pool_hint[0]))) + BATCH + 1)
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
