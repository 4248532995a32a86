"""The eBPF backend's host side: what is done once per host and kept by a process.

- ``objects``: what the host part is made of (the sources, the programs, the maps: one table);
- ``loader`` and ``launch``: the short-lived process that compiles them with bcc, loads and pins
  them under a bpffs root and attaches the cgroup programs, and its start;
- ``pins``: where they are pinned, which pins are missing, the host lock, what the host offers;
- ``syscalls``: bpf(2) through the native module (``Map``, pins, links);
- ``programs``: ``HostPrograms``, a process's handle on the pinned objects (open, load, repair,
  recover, what is wrong with them);
- ``pool``: the pods' sk_lookup programs, loaded ahead;
- ``pods``: the pods' records in the host maps, keyed by netns cookie, and ``PodStore``, the one
  view of a handle the per-pod side (``..pod``) is given;
- ``lifetime``: ``Process``, the handles a process keeps (one per pin root, watched), and the
  garbage collection.

Nothing here imports the per-pod side.
"""

from __future__ import annotations

from .lifetime import PROCESS, Process, collect_garbage, host, reading, registered_pods
from .objects import PROGRAMS, build_id
from .pins import probe_kernel, resolve_cgroup, resolve_root
from .pods import PodState, PodStore, PodWrite, pod_link, setup_failed
from .programs import HostPrograms, count_pods, host_problems
from .syscalls import NATIVE, check, detach_pinned

__all__ = ["PROCESS", "Process", "collect_garbage", "host", "reading", "registered_pods", "PROGRAMS", "build_id",
           "probe_kernel", "resolve_cgroup", "resolve_root", "PodState", "PodStore", "PodWrite", "pod_link",
           "setup_failed", "HostPrograms", "count_pods", "host_problems", "NATIVE", "check", "detach_pinned"]
