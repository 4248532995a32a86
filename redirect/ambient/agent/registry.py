"""The pods the agent holds, and the one lock that orders them against the node proxies.

``pods`` are enrolled (their commit record written); ``enrolling`` ones have been handed to
the proxies but not committed yet (a proxy that connects meanwhile gets them in its
snapshot); ``claims`` says which add works in which netns (by inode). Everything here is
memory: the records are in the agent's store on the node (``store``), the rest in the kernel,
and a restarted agent reads them back (``reconcile``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .metrics import Metrics
from .pods import PodRecord

#: Locks that order the pods' adds, dels and resyncs (``uid_lock``); more than ``--workers`` can use.
UID_LOCKS = 256


class Registry:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        #: Guards pods, enrolling, claims and the hub's proxy list: a pod is handed to the
        #: proxies and a proxy gets its snapshot under it, so no proxy misses a pod.
        self.lock = threading.Lock()
        self.pods: dict[str, PodRecord] = {}
        self.enrolling: dict[str, PodRecord] = {}
        self.claims: dict[int, str] = {}  # netns inode -> uid of the add working in it
        self._uid_locks = tuple(threading.Lock() for _ in range(UID_LOCKS))

    def uid_lock(self, uid: str) -> threading.Lock:
        """The lock that orders a pod's add, del and resync: one of ``UID_LOCKS``, by the uid's hash
        (striped: however many uids come and go, the table does not grow; two uids that share a
        lock only wait for each other). Nobody holds two of them at once."""
        return self._uid_locks[hash(uid) % UID_LOCKS]

    def counted(self) -> None:
        """Update the enrolled-pods gauge (under ``lock``)."""
        self.metrics.set("pods_enrolled", len(self.pods))

    def replace(self, pods: dict[str, PodRecord]) -> None:
        """The pods found in the kernel (at start) become ours."""
        with self.lock:
            self.pods = pods
            self.counted()

    def commit(self, pod: PodRecord) -> None:
        with self.lock:
            self.enrolling.pop(pod.uid, None)
            self.pods[pod.uid] = pod
            self.counted()

    def claim(self, pod: PodRecord, same_netns: Callable[[str, tuple[int, int]], bool]) -> str | None:
        """Claim ``pod``'s netns for its add: None, or the uid of the pod that holds it (enrolled,
        being enrolled, or claimed). ``same_netns(path, key)`` says whether a pod's netns is
        still the one it was enrolled in (a pod whose netns is gone holds nothing)."""
        with self.lock:
            other = self.claims.get(pod.inode)
            for p in (*self.pods.values(), *self.enrolling.values()):
                if other is None and p.uid != pod.uid and p.key == pod.key and same_netns(p.netns, p.key):
                    other = p.uid
            if other is None or other == pod.uid:
                self.claims[pod.inode] = pod.uid
                return None
            return other

    def release(self, pod: PodRecord) -> None:
        with self.lock:
            if self.claims.get(pod.inode) == pod.uid:
                del self.claims[pod.inode]
