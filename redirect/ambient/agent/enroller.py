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

import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

from ...config import RedirectConfig
from ...errors import ConfigError, RedirectError, SetupError
from .hub import ProxyHub
from .logs import jlog
from .ops import NetnsRef, Ops
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
        """Enrol a pod (the transaction above); the reply's fields. Its netns is opened once, and
        every step acts on that open netns (the proxies get a copy of the fd), never on its path
        again: a path that names another netns meanwhile changes nothing."""
        fields, path = self._fields(raw)
        with self._opened(path) as (ref, key):
            pod = self._pod(fields, path, ref, key)
            with self.registry.uid_lock(pod.uid):
                self._claim(pod)
                try:
                    proxies = self._enrol(pod, ref)
                finally:
                    self.registry.release(pod)
        jlog(logging.INFO, "pod enrolled", pod=pod.uid, name=pod.name, namespace=pod.namespace, netns=pod.netns,
             ips=list(pod.ips), proxies=proxies, backend=pod.backend)
        return {"enrolled": True, "pod": pod.uid, "proxies": proxies}

    @contextlib.contextmanager
    def _opened(self, path: str, key: tuple[int, int] | None = None,
                reason: str = "netns") -> Iterator[tuple[NetnsRef, tuple[int, int]]]:
        """The netns at ``path``, opened once for one operation (``key``: it must be that netns);
        ``EventError`` (``reason``) if it can't be."""
        try:
            ref, got = self.ops.open_netns(path, key)
        except RedirectError as e:
            raise EventError(reason, str(e)) from None
        try:
            yield ref, got
        finally:
            self.ops.close_netns(ref)

    def parse_pod(self, pod: Any) -> PodRecord:
        """An ``add`` event's pod, validated (``EventError`` naming the field, nothing changed)."""
        fields, path = self._fields(pod)
        with self._opened(path) as (ref, key):
            return self._pod(fields, path, ref, key)

    def _fields(self, pod: Any) -> tuple[dict[str, Any], str]:
        """An ``add`` event's fields but its netns, validated; and the netns path it names."""
        if not isinstance(pod, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(pod, "pod")
        path = text(pod, "netns", "pod", required=True, limit=4096)
        ips = ips_of(pod.get("ips") or [], "pod.ips")
        backend = backend_of(pod.get("backend"), "pod.backend", self.backend)
        cfg = self._pod_config(pod)
        return dict(uid=uid, name=text(pod, "name", "pod"), namespace=text(pod, "namespace", "pod", limit=63),
                    ips=ips, container_id=text(pod, "container_id", "pod", limit=128), backend=backend,
                    config=cfg, node=self.node_name), path

    def _pod(self, fields: dict[str, Any], path: str, ref: NetnsRef, key: tuple[int, int]) -> PodRecord:
        """The pod of ``fields`` in the netns ``ref`` (opened at ``path``), refused (``netns``) if
        that is the host's (before anything is written there)."""
        try:
            host = self.ops.host_netns_reason(ref)
        except RedirectError as e:
            raise EventError("netns", str(e)) from None
        if host is not None:
            raise EventError("netns", f"pod.netns={path!r}: {host}: refused")
        return PodRecord(netns=path, inode=key[0], cookie=key[1], **fields)

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

    def _enrol(self, pod: PodRecord, ref: NetnsRef) -> int:
        """The steps of ``add`` (under the pod's uid lock and netns claim) in the netns ``ref``;
        how many proxies acked."""
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
            self.ops.setup_rules(ref, pod.config, pod.backend)
            fault("add.rules")
            if self.host_rules and pod.ips:
                try:
                    self.ops.add_node_ips(pod.ips, pod.uid)
                except SetupError:  # the node sets went away since the start: put them back once
                    self.ops.setup_node()
                    self.ops.add_node_ips(pod.ips, pod.uid)
                fault("add.node_set")
            with reg.lock:
                waiters = self.hub.offer_locked(pod, ref)
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
            self.rollback(pod, ref)
            if isinstance(e, EventError):
                raise
            if isinstance(e, RedirectError):
                raise EventError("setup", str(e)) from None
            raise

    def rollback(self, pod: PodRecord, ref: NetnsRef | None = None) -> None:
        """Undo a failed add, whether or not the pod was enrolled before (the runtime retries or DELs);
        ``ref``: its netns as the add opened it."""
        reg = self.registry
        with reg.lock:
            reg.pods.pop(pod.uid, None)
            reg.enrolling.pop(pod.uid, None)
            reg.counted()
            self.hub.withdraw_locked(pod.uid)
        self.undo(pod, "failed add rolled back", ref)

    def undo(self, pod: PodRecord, why: str, ref: NetnsRef | None = None) -> None:
        """Remove every piece of ``pod`` the kernel may hold (rules, routes and an earlier release's
        in-pod record in its netns: ``ref``, or the one at its path if that is still the pod's;
        node-set entries it owns; its record last), each step on its own so one failure does not
        stop the others."""
        with contextlib.ExitStack() as st:
            if ref is None:
                try:
                    ref, _ = self.ops.open_netns(pod.netns, pod.key)
                    st.callback(self.ops.close_netns, ref)
                except RedirectError:
                    ref = None  # its netns is gone (or not at its path): nothing of it to remove there
            netns = ref
            steps: list[tuple[str, Callable[[], object]]] = []
            if netns is not None:
                steps += [("rules", lambda: self.ops.teardown_rules(netns)),
                          ("in-pod record", lambda: self.ops.clear_legacy(netns))]
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
        """Whether the pod is enrolled in that netns (the one at the path named, else at its
        recorded path: it must still be there), its rules are as recorded, and a proxy has it."""
        if not isinstance(raw, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(raw, "pod")
        path = text(raw, "netns", "pod", limit=4096)
        with self.registry.lock:
            rec = self.registry.pods.get(uid)
            proxies = self.hub.synced_locked()
        if rec is None:
            raise EventError("check", f"pod {uid} is not enrolled on this node")
        try:
            ref, _ = self.ops.open_netns(path or rec.netns, rec.key)
        except RedirectError as e:
            if path:
                raise EventError("check", f"pod {uid} is enrolled in another netns than {path}: {e}") from None
            raise EventError("check", f"pod {uid}: its netns is gone or replaced: {e}") from None
        try:
            res = self.ops.check_rules(ref, rec.config, rec.backend)
        except RedirectError as e:
            raise EventError("check", str(e)) from None
        finally:
            self.ops.close_netns(ref)
        if not res.ok:
            raise EventError("check", f"pod {uid}: rules differ: " + "; ".join(res.differences))
        if not proxies:
            raise EventError("check", f"pod {uid}: no node proxy is connected")
        return {"pod": uid, "proxies": proxies}

    def delete(self, raw: Any) -> dict[str, Any]:
        """Remove a pod: the proxies told, its rules and record (if the netns is still its), its
        node-set entries. A pod this agent does not know is cleaned up as far as it is found. The
        netns the del names is opened once, and what is removed there is removed through that
        open netns; the pod's own netns, when the del names none, only if it is still the pod's."""
        if not isinstance(raw, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(raw, "pod", required=False)
        path = text(raw, "netns", "pod", limit=4096)
        cid = text(raw, "container_id", "pod", limit=128)
        if not uid and not cid:
            raise EventError("bad_request", "pod: a del needs uid or container_id")
        with contextlib.ExitStack() as st:
            named: NetnsRef | None = None  # the netns the del names, if it is one
            target = None
            if path:
                try:
                    named, target = self.ops.open_netns(path)
                    st.callback(self.ops.close_netns, named)
                except (RedirectError, OSError):
                    pass  # gone (the runtime may call DEL after the netns went), or not a netns
            if named is not None:
                try:
                    host = self.ops.host_netns_reason(named)
                except (RedirectError, OSError):
                    host = None
                if host is not None:  # the host's (the agent's own, the initial one, pid 1's): nothing changed
                    raise EventError("netns", f"pod.netns={path!r}: {host}: refused; nothing was changed")
            return self._delete(uid, cid, path, named, target, st)

    def _delete(self, uid: str, cid: str, path: str, named: NetnsRef | None, target: tuple[int, int] | None,
                st: contextlib.ExitStack) -> dict[str, Any]:
        reg = self.registry
        if not uid:
            with reg.lock:
                uid = next((p.uid for p in reg.pods.values() if p.container_id == cid), "")
            if not uid:
                return {"removed": False}
        with reg.uid_lock(uid):
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
            where = named
            if where is None and same and rec is not None:
                try:
                    where, _ = self.ops.open_netns(rec.netns, rec.key)
                    st.callback(self.ops.close_netns, where)
                except (RedirectError, OSError):
                    where = None  # gone, or its path names another netns by now: nothing to remove there
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
