"""Restart safety: the pods read back from the agent's records at start, and the repairs while running.

At start (``reconcile``) the agent re-asserts the node's probe rules, removes every piece of
an enrolment cut short (an intent record without its commit), re-installs drifted rules of
the committed pods (and removes an earlier release's in-pod record from their netns), puts
their IPs back in the node sets and drops set entries of uids it did not adopt; the committed
pods become its own. Whatever a pod's netns holds is compared with the record and repaired,
never believed. While running (``resync``, every ``--resync-seconds``) it repeats the repairs
for the pods enrolled now and drops a pod whose netns is gone without a ``del`` (its record
too): found neither at its path nor where the start would find it (a pod whose path names its
netns no more, as a ``/proc/<pid>/ns/net`` whose process exited, is known by the path found).
What it changes in the kernel and the store goes through an ``ops.Ops``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time

from ...errors import RedirectError
from .enroller import Enroller
from .logs import jlog, log
from .metrics import Metrics
from .pods import PodRecord


class Reconciler:
    def __init__(self, enroller: Enroller, metrics: Metrics, *, workers: int) -> None:
        self.enroller = enroller
        self.registry = enroller.registry
        self.hub = enroller.hub
        self.ops = enroller.ops
        self.host_rules = enroller.host_rules
        self.metrics = metrics
        self.workers = workers

    def reconcile(self) -> None:
        """At start: the pods the agent's records name become its own, repaired (see above)."""
        t0 = time.monotonic()
        if self.host_rules:
            self.ops.setup_node()
        found = self.ops.discover()
        for pod in found.unfinished:
            self.enroller.undo(pod, "an enrolment cut short (no commit record): removed")
            self.metrics.inc("reconciled", "removed")
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers) as ex:
            results = list(ex.map(self.fix_rules, found.enrolled.values()))
            for pod in found.enrolled.values():
                ex.submit(self.clear_legacy, pod)
        for r in results:
            self.metrics.inc("reconciled", r)
        for _ in range(found.gone):
            self.metrics.inc("reconciled", "gone")
        if self.host_rules:
            for pod in found.enrolled.values():
                if pod.ips:
                    try:
                        self.ops.add_node_ips(pod.ips, pod.uid)
                    except Exception as e:  # noqa: BLE001 - one pod never stops the agent
                        jlog(logging.ERROR, "node set entries could not be added", pod=pod.uid, error=str(e))
            stale: dict[str, list[str]] = {}
            for ip, owner in self.ops.node_ips().items():
                if owner and owner not in found.enrolled:
                    stale.setdefault(owner, []).append(ip)
            for owner, ips in stale.items():
                try:
                    self.ops.remove_node_ips(ips, owner)
                    jlog(logging.INFO, "removed node set entries of a pod that is gone", pod=owner, ips=ips)
                except Exception as e:  # noqa: BLE001
                    jlog(logging.ERROR, "stale node set entries could not be removed", pod=owner, error=str(e))
        self.registry.replace(found.enrolled)
        jlog(logging.INFO, "reconciled", pods=len(found.enrolled), ms=round((time.monotonic() - t0) * 1e3, 1),
             removed=len(found.unfinished), gone=found.gone, ignored=found.ignored,
             **{r: results.count(r) for r in ("intact", "repaired", "failed")})

    def fix_rules(self, pod: PodRecord) -> str:
        """Re-install the pod's rules if they differ from its recorded config: intact, repaired,
        failed, or gone (its netns is found nowhere: nothing is touched). The netns is looked for
        as the start looks for it (at its path, else by inode and cookie among the node's netns
        paths: a ``/proc/<pid>/ns/net`` whose process exited names the pod's netns no more, but
        another path may), opened once, as the pod's (inode and cookie), and checked and repaired
        through that fd; a path that names another netns now is never acted on. A pod found at
        another path is known by that path from then on."""
        try:
            ref, where = self.ops.find_netns(pod.netns, pod.key)
        except RedirectError as e:
            jlog(logging.WARNING, "pod netns is not at its path", pod=pod.uid, netns=pod.netns, error=str(e))
            return "gone"
        if where != pod.netns:
            jlog(logging.INFO, "pod netns found at another path", pod=pod.uid, netns=where, was=pod.netns,
                 netns_inode=pod.inode)
            with self.registry.lock:
                pod.netns = where  # (every holder of the record, a proxy's queued add too, opens it there now)
        try:
            if self.ops.check_rules(ref, pod.config, pod.backend).ok:
                return "intact"
            self.ops.setup_rules(ref, pod.config, pod.backend)
            jlog(logging.WARNING, "pod rules had drifted: re-installed", pod=pod.uid, netns=pod.netns)
            return "repaired"
        except Exception as e:  # noqa: BLE001 - one pod never stops the agent
            jlog(logging.ERROR, "pod rules could not be repaired", pod=pod.uid, netns=pod.netns, error=str(e))
            return "failed"
        finally:
            self.ops.close_netns(ref)

    def clear_legacy(self, pod: PodRecord) -> None:
        """Remove an earlier release's record from the pod's netns (the record is on the node now)."""
        try:
            ref, _ = self.ops.open_netns(pod.netns, pod.key)
        except RedirectError:
            return
        try:
            if self.ops.clear_legacy(ref):
                jlog(logging.INFO, "an earlier release's record inside the pod's netns removed", pod=pod.uid,
                     netns=pod.netns)
        except Exception as e:  # noqa: BLE001 - one pod never stops the agent
            jlog(logging.WARNING, "an earlier release's in-pod record could not be removed", pod=pod.uid,
                 netns=pod.netns, error=str(e))
        finally:
            self.ops.close_netns(ref)

    def resync(self, stopping: threading.Event | None = None) -> dict[str, int]:
        """While running: the start's repairs for the pods enrolled now (drifted rules, node probe
        rules, node-set entries); a pod whose netns is gone without a ``del`` is dropped (proxies
        told, node-set entries removed). Counts by result."""
        counts: dict[str, int] = {}
        if self.host_rules:
            try:
                if self.ops.setup_node():
                    jlog(logging.WARNING, "node probe rules had drifted: re-installed")
            except RedirectError as e:
                jlog(logging.ERROR, "node probe rules could not be re-asserted", error=str(e))
        reg = self.registry
        with reg.lock:
            pods = list(reg.pods.values())
        for pod in pods:
            if stopping is not None and stopping.is_set():
                break
            with reg.uid_lock(pod.uid):
                with reg.lock:
                    if reg.pods.get(pod.uid) is not pod:
                        continue  # added again or deleted meanwhile
                r = self.fix_rules(pod)
                if r == "gone":
                    self.forget(pod)
                elif self.host_rules and pod.ips:
                    try:
                        self.ops.add_node_ips(pod.ips, pod.uid)
                    except RedirectError as e:
                        jlog(logging.ERROR, "node set entries could not be re-added", pod=pod.uid, error=str(e))
            counts[r] = counts.get(r, 0) + 1
            self.metrics.inc("resynced", r)
        return counts

    def forget(self, pod: PodRecord) -> None:
        """Drop a pod whose netns is gone: the proxies told, its node-set entries and record removed."""
        reg = self.registry
        with reg.lock:
            if reg.pods.get(pod.uid) is pod:
                del reg.pods[pod.uid]
            reg.counted()
            waiters = self.hub.withdraw_locked(pod.uid)
        self.hub.wait_all(waiters)
        if self.host_rules and pod.ips:
            with contextlib.suppress(RedirectError):
                self.ops.remove_node_ips(pod.ips, pod.uid)
        try:
            rec = self.ops.read_record(pod.key)
            if rec is not None and rec.get("uid") == pod.uid:
                self.ops.clear_record(pod.key)
        except (RedirectError, OSError, ValueError) as e:
            jlog(logging.ERROR, "the record of a pod whose netns is gone could not be removed", pod=pod.uid,
                 error=str(e))
        jlog(logging.WARNING, "pod netns is gone without a del: pod dropped", pod=pod.uid, netns=pod.netns)

    def loop(self, every: float, stopping: threading.Event) -> None:
        """``resync`` every ``every`` seconds until ``stopping``."""
        while not stopping.wait(every):
            try:
                counts = self.resync(stopping)
                if set(counts) - {"intact"}:
                    jlog(logging.INFO, "resynced", **counts)
            except Exception:  # noqa: BLE001 - the loop must go on
                log.exception("resync failed")
