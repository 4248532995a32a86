"""The enrolment transaction of an ambient pod, its undo, ``del`` and ``check``.

``add`` enrols a pod as a transaction whose commit record is written last:

1. an *intent* record in the agent's store on the node (``store``: what to remove if the agent
   dies before 5.);
2. the in-pod routes and rules (``redirect.setup``);
3. the pod's IPs in the node probe sets, owned by its uid;
4. the netns handed to every connected node proxy, and all their acks;
5. the *commit* record (``phase: enrolled``) replaces the intent: the pod is enrolled.

A failure undoes every step (``rollback``). A restarted agent adopts only pods with a commit
record and removes the pieces of one that has only the intent (``undo``, from ``reconcile``).
What it changes in the kernel goes through an ``ops.Ops``.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from ...config import RedirectConfig
from ...errors import ConfigError, RedirectError, SetupError
from .hub import ProxyHub
from .logs import jlog
from .ops import Ops
from .pods import ENROLLED, INTENT, BadPod, PodRecord, ambient_config, backend_of, ips_of, text, uid_of
from .registry import Registry

#: Fault injection for the kill-point tests: ``REDIRECT_AGENT_FAULT=<point>`` makes the agent
#: SIGKILL itself when it reaches ``<point>`` (see ``FAULT_POINTS``), as a crash there would.
FAULT_ENV = "REDIRECT_AGENT_FAULT"
FAULT_POINTS = ("add.start", "add.intent", "add.rules", "add.node_set", "add.proxy_sent", "add.proxy_acked",
                "add.committed")


def fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        jlog(logging.CRITICAL, "fault point reached: the agent kills itself", point=point)
        for h in logging.getLogger("redirect").handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class EventError(Exception):
    """A pod event failed; ``reason`` is the metrics label and the reply's ``reason``."""

    def __init__(self, reason: str, msg: str) -> None:
        super().__init__(msg)
        self.reason = reason


class Enroller:
    """``add``, ``del`` and ``check`` of pods: ``base`` is the pods' config before annotations,
    ``backend`` the one of a pod whose event names none; ``host_rules``: the node's probe sets
    are ours to manage."""

    def __init__(self, registry: Registry, hub: ProxyHub, ops: Ops, *, base: RedirectConfig, backend: str,
                 node_name: str, host_rules: bool) -> None:
        self.registry = registry
        self.hub = hub
        self.ops = ops
        self.base = base
        self.backend = backend
        self.node_name = node_name
        self.host_rules = host_rules

    # -- add

    def add(self, raw: Any) -> dict[str, Any]:
        """Enrol a pod (the transaction above); the reply's fields."""
        pod = self.parse_pod(raw)
        with self.registry.uid_lock(pod.uid):
            self._claim(pod)
            try:
                proxies = self._enrol(pod)
            finally:
                self.registry.release(pod)
        jlog(logging.INFO, "pod enrolled", pod=pod.uid, name=pod.name, namespace=pod.namespace, netns=pod.netns,
             ips=list(pod.ips), proxies=proxies, backend=pod.backend)
        return {"enrolled": True, "pod": pod.uid, "proxies": proxies}

    def parse_pod(self, pod: Any) -> PodRecord:
        """An ``add`` event's pod, validated (``EventError`` naming the field, nothing changed)."""
        if not isinstance(pod, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(pod, "pod")
        path = text(pod, "netns", "pod", required=True, limit=4096)
        ips = ips_of(pod.get("ips") or [], "pod.ips")
        backend = backend_of(pod.get("backend"), "pod.backend", self.backend)
        cfg = self._pod_config(pod)
        try:
            inode, cookie = self.ops.netns_key(path)
            host = self.ops.host_netns_reason(path)  # (before anything is written there)
        except RedirectError as e:
            raise EventError("netns", str(e)) from None
        if host is not None:
            raise EventError("netns", f"pod.netns={path!r}: {host}: refused")
        return PodRecord(uid=uid, name=text(pod, "name", "pod"), namespace=text(pod, "namespace", "pod", limit=63),
                         netns=path, inode=inode, cookie=cookie, ips=ips,
                         container_id=text(pod, "container_id", "pod", limit=128), backend=backend, config=cfg,
                         node=self.node_name)

    def _pod_config(self, pod: dict[str, Any]) -> RedirectConfig:
        from ...istio.annotations import config_from_annotations

        try:
            if "config" in pod and pod["config"] is not None:
                return ambient_config(pod["config"], "pod.config")
            ann = pod.get("annotations") or {}
            if not isinstance(ann, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ann.items()):
                raise EventError("bad_request", "pod.annotations: expected an object of strings")
            cfg = config_from_annotations(ann, self.base)
        except ConfigError as e:
            raise EventError("bad_annotation", str(e)) from None
        except BadPod as e:
            raise EventError("bad_annotation" if e.field.startswith("pod.config.") else "bad_request", str(e)) from None
        if cfg.mode != "ambient":
            raise EventError("bad_request", f"pod.config.mode={cfg.mode!r}: the agent enrols ambient pods only")
        return cfg

    def _claim(self, pod: PodRecord) -> None:
        """Claim ``pod``'s netns for this add, or refuse (``netns``) if another pod holds it: enrolled,
        being enrolled (claimed), or recorded there (in the agent's store). Nothing is changed by a
        refusal."""
        other = self.registry.claim(pod, self.ops.same_netns)
        if other is None:
            try:
                rec = self.ops.read_record(pod.key)
            except (RedirectError, ValueError) as e:  # (the store, or the record, is not as it must be)
                self.registry.release(pod)
                raise EventError("setup", str(e)) from None
            if rec is not None and rec.get("uid") != pod.uid:
                other = str(rec.get("uid"))[:128]
                self.registry.release(pod)
        if other is not None:
            raise EventError("netns", f"pod.netns={pod.netns!r}: that netns is pod {other}'s; nothing was changed")

    def _enrol(self, pod: PodRecord) -> int:
        """The steps of ``add`` (under the pod's uid lock and netns claim); how many proxies acked."""
        reg = self.registry
        with reg.lock:
            if not self.hub.conns:
                raise EventError("no_proxy", "no node proxy is connected: the pod would have no proxy")
            cur = reg.pods.get(pod.uid)
        try:
            fault("add.start")
            if cur is None or cur.key != pod.key:  # a repeated add keeps its commit record
                self.ops.write_record(pod.key, pod.record(INTENT))
                fault("add.intent")
            self.ops.setup_rules(pod.netns, pod.config, pod.backend)
            fault("add.rules")
            if self.host_rules and pod.ips:
                try:
                    self.ops.add_node_ips(pod.ips, pod.uid)
                except SetupError:  # the node sets went away since the start: put them back once
                    self.ops.setup_node()
                    self.ops.add_node_ips(pod.ips, pod.uid)
                fault("add.node_set")
            with reg.lock:
                waiters = self.hub.offer_locked(pod)
            fault("add.proxy_sent")
            if not waiters:
                raise EventError("no_proxy", "no node proxy is connected")
            errors = self.hub.wait_all(waiters)
            if errors:
                raise EventError("proxy", "node proxy did not take the pod: " + "; ".join(errors))
            fault("add.proxy_acked")
            self.ops.write_record(pod.key, pod.record(ENROLLED))
            fault("add.committed")
            reg.commit(pod)
            return len(waiters)
        except Exception as e:
            self.rollback(pod)
            if isinstance(e, EventError):
                raise
            if isinstance(e, RedirectError):
                raise EventError("setup", str(e)) from None
            raise

    def rollback(self, pod: PodRecord) -> None:
        """Undo a failed add, whether or not the pod was enrolled before (the runtime retries or DELs)."""
        reg = self.registry
        with reg.lock:
            reg.pods.pop(pod.uid, None)
            reg.enrolling.pop(pod.uid, None)
            reg.counted()
            self.hub.withdraw_locked(pod.uid)
        self.undo(pod, "failed add rolled back")

    def undo(self, pod: PodRecord, why: str) -> None:
        """Remove every piece of ``pod`` the kernel may hold (rules, routes and an earlier release's
        in-pod record while its netns is still at its path; node-set entries it owns; its record
        last), each step on its own so one failure does not stop the others."""
        steps: list[tuple[str, Callable[[], object]]] = []
        if self.ops.same_netns(pod.netns, pod.key):
            steps += [("rules", lambda: self.ops.teardown_rules(pod.netns)),
                      ("in-pod record", lambda: self.ops.clear_legacy(pod.netns))]
        if self.host_rules and pod.ips:
            steps.append(("node set", lambda: self.ops.remove_node_ips(pod.ips, pod.uid)))
        steps.append(("record", lambda: self._clear_record(pod)))
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - report, keep undoing
                jlog(logging.ERROR, "undo step failed", pod=pod.uid, step=what, error=str(e))
        jlog(logging.WARNING, why, pod=pod.uid, netns=pod.netns)

    def _clear_record(self, pod: PodRecord) -> None:
        """Remove the record of ``pod``'s netns if it is this pod's (another pod's is never touched)."""
        rec = self.ops.read_record(pod.key)
        if rec is not None and rec.get("uid") == pod.uid:
            self.ops.clear_record(pod.key)

    # -- check and del

    def check(self, raw: Any) -> dict[str, Any]:
        """Whether the pod is enrolled in that netns, its rules are as recorded, and a proxy has it."""
        if not isinstance(raw, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(raw, "pod")
        path = text(raw, "netns", "pod", limit=4096)
        with self.registry.lock:
            rec = self.registry.pods.get(uid)
            proxies = self.hub.synced_locked()
        if rec is None:
            raise EventError("check", f"pod {uid} is not enrolled on this node")
        if path and not self.ops.same_netns(path, rec.key):
            raise EventError("check", f"pod {uid} is enrolled in another netns than {path}")
        try:
            res = self.ops.check_rules(rec.netns, rec.config, rec.backend)
        except RedirectError as e:
            raise EventError("check", str(e)) from None
        if not res.ok:
            raise EventError("check", f"pod {uid}: rules differ: " + "; ".join(res.differences))
        if not proxies:
            raise EventError("check", f"pod {uid}: no node proxy is connected")
        return {"pod": uid, "proxies": proxies}

    def _refuse_host(self, path: str) -> None:
        """``EventError`` (``netns``) if ``path`` names the host's network namespace (the agent's own,
        the initial one, pid 1's): a del there changes nothing. A path that names no namespace (any
        more) is no refusal: the pod's netns may be gone."""
        if not path:
            return
        try:
            host = self.ops.host_netns_reason(path)
        except (RedirectError, OSError):
            return
        if host is not None:
            raise EventError("netns", f"pod.netns={path!r}: {host}: refused; nothing was changed")

    def delete(self, raw: Any) -> dict[str, Any]:
        """Remove a pod: the proxies told, its rules and record (if the netns is still its), its
        node-set entries. A pod this agent does not know is cleaned up as far as it is found."""
        if not isinstance(raw, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(raw, "pod", required=False)
        path = text(raw, "netns", "pod", limit=4096)
        cid = text(raw, "container_id", "pod", limit=128)
        if not uid and not cid:
            raise EventError("bad_request", "pod: a del needs uid or container_id")
        self._refuse_host(path)
        reg = self.registry
        if not uid:
            with reg.lock:
                uid = next((p.uid for p in reg.pods.values() if p.container_id == cid), "")
            if not uid:
                return {"removed": False}
        with reg.uid_lock(uid):
            target = None  # the netns the del names, if it is one
            if path:
                try:
                    target = self.ops.netns_key(path)
                except (RedirectError, OSError):
                    pass  # gone (the runtime may call DEL after the netns went), or not a netns
            with reg.lock:
                rec = reg.pods.get(uid)
                same = rec is not None and (target is None or target == rec.key)
                waiters = []
                if same:
                    del reg.pods[uid]
                    reg.counted()
                    waiters = self.hub.withdraw_locked(uid)
            errors = self.hub.wait_all(waiters)
            if errors:
                jlog(logging.WARNING, "node proxy did not ack a delete", pod=uid, errors=errors)
            key = target if target is not None else (rec.key if same and rec is not None else None)
            where = path if target is not None else None
            if where is None and same and rec is not None and self.ops.same_netns(rec.netns, rec.key):
                where = rec.netns
            if key is not None:
                backend = rec.backend if rec is not None else self.backend
                try:
                    found = self.ops.read_record(key)
                    if found is None or found.get("uid") == uid:  # another pod's netns is left alone
                        if where is not None:
                            self.ops.teardown_rules(where, backend)
                            self.ops.clear_legacy(where)
                        self.ops.clear_record(key)
                except (RedirectError, ValueError) as e:
                    raise EventError("teardown", str(e)) from None
            if self.host_rules:
                mine = [ip for ip, owner in self.ops.node_ips().items() if owner == uid]
                if mine and (same or rec is None):
                    self.ops.remove_node_ips(mine, uid)
        jlog(logging.INFO, "pod removed", pod=uid, netns=path, known=rec is not None)
        return {"removed": rec is not None, "pod": uid}
