"""A container's Kubernetes ``securityContext`` as the process a container runtime starts from it.

``creds_of(container, pod_spec)`` translates the way the kubelet and containerd's CRI plugin do:

- uid and gid: the container's ``runAsUser``/``runAsGroup``, else the pod's, else the image's
  user (root unless ``image_user`` says otherwise); supplementary groups: the pod's
  ``supplementalGroups`` (none otherwise);
- capabilities: ``privileged: true`` gives every capability the kernel has (that the runtime
  holds); otherwise containerd's
  default set for a non-privileged container (``defaultUnixCaps`` in containerd's ``oci/spec.go``),
  then ``add: [ALL]`` (every one), then ``drop: [ALL]`` (none), then the other ``add`` and ``drop``
  names, as the CRI plugin applies them. The set is the process's bounding, permitted and
  effective set; the inheritable and ambient sets are empty (containerd leaves them so). A
  container process that is not root loses its permitted and effective capabilities when the
  runtime execs it (no ambient ones, no file capabilities), so its effective set is empty;
- ``allowPrivilegeEscalation: false`` sets ``no_new_privs``.

``Creds.setpriv()`` is the ``setpriv`` command prefix that puts a process in exactly that state,
from a root shell (after what only the runtime does as full root: namespaces and mounts).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redirect.kernel.caps import NAMES

#: containerd's capabilities for a container that is not privileged and drops none.
CONTAINERD_DEFAULT_CAPS = frozenset({
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP", "SETPCAP",
    "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
})


@functools.lru_cache(maxsize=1)
def kernel_caps() -> frozenset[str]:
    """Every capability ``privileged: true`` grants: those of the kernel that the runtime holds
    itself (a runtime in a sandbox that lacks one cannot give it; here, this test process)."""
    with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
        last = int(f.read())
    return frozenset(NAMES[: last + 1]) & read_status().bounding


def _cap_name(raw: object, where: str) -> str:
    if not isinstance(raw, str) or not re.fullmatch(r"(?i)(cap_)?[a-z_]+", raw):
        raise ValueError(f"{where}: {raw!r} is not a capability name")
    name = raw.upper().removeprefix("CAP_")
    if name != "ALL" and name not in NAMES:
        raise ValueError(f"{where}: {raw!r} is not a capability this kernel knows")
    return name


@dataclass(frozen=True)
class Creds:
    """What a container's process runs with, as the runtime starts it."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    bounding: frozenset[str]
    effective: frozenset[str]  # also the permitted set
    no_new_privs: bool

    def setpriv(self) -> list[str]:
        """``setpriv ... --``: run what follows with exactly these credentials."""
        bounding = ",".join(["-all", *(f"+{c.lower()}" for c in sorted(self.bounding))])
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", groups, f"--bounding-set={bounding}",
                "--inh-caps=-all", "--ambient-caps=-all", *(["--no-new-privs"] if self.no_new_privs else []), "--"]


def creds_of(container: Mapping[str, Any], pod_spec: Mapping[str, Any] | None = None,
             image_user: tuple[int, int] = (0, 0)) -> Creds:
    """The credentials the runtime gives ``container`` of a pod whose spec is ``pod_spec``."""
    name = container.get("name", "?")
    sc: Mapping[str, Any] = container.get("securityContext") or {}
    pod_sc: Mapping[str, Any] = (pod_spec or {}).get("securityContext") or {}
    uid = sc.get("runAsUser", pod_sc.get("runAsUser", image_user[0]))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", image_user[1]))
    groups = tuple(sorted(set(pod_sc.get("supplementalGroups") or ())))
    if sc.get("privileged") is True:
        caps = set(kernel_caps())
    else:
        caps = set(CONTAINERD_DEFAULT_CAPS)
        spec_caps: Mapping[str, Any] = sc.get("capabilities") or {}
        add = [_cap_name(c, f"{name}.capabilities.add") for c in spec_caps.get("add") or ()]
        drop = [_cap_name(c, f"{name}.capabilities.drop") for c in spec_caps.get("drop") or ()]
        if "ALL" in add:
            caps = set(kernel_caps())
        if "ALL" in drop:
            caps = set()
        caps |= {c for c in add if c != "ALL"}
        caps -= {c for c in drop if c != "ALL"}
    bounding = frozenset(caps)
    return Creds(uid=int(uid), gid=int(gid), groups=groups, bounding=bounding,
                 effective=bounding if uid == 0 else frozenset(),
                 no_new_privs=sc.get("allowPrivilegeEscalation") is False and sc.get("privileged") is not True)


def read_status(pid: int | str = "self") -> Creds:
    """The credentials a live process has (``/proc/PID/status``), to compare with ``creds_of``."""
    fields: dict[str, str] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()

    def caps(key: str) -> frozenset[str]:
        bits = int(fields[key], 16)
        return frozenset(n for i, n in enumerate(NAMES) if bits >> i & 1)

    return Creds(uid=int(fields["Uid"].split()[1]), gid=int(fields["Gid"].split()[1]),
                 groups=tuple(sorted(int(g) for g in fields["Groups"].split())), bounding=caps("CapBnd"),
                 effective=caps("CapEff"), no_new_privs=fields.get("NoNewPrivs") == "1")
