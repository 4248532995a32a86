"""The eBPF backend's per-pod side: what one pod's setup, check and teardown do, through the host side's
``PodStore`` (``..host.pods``) and nothing else of it.

- ``entries``: what an intent writes, packed from its eBPF lowering (``redirect.plan.lower_ebpf``),
  and how entries read as text;
- ``network``: what the pod's netns holds (its cookie and addresses, the proxy's listeners, its
  links and routes, our address);
- ``tc``: the tc filters of a pod that forwards;
- ``userns``: the owner ids of a pod whose netns a user namespace of its own owns, as the host
  numbers them (``hostUsers: false``);
- ``fresh``: a fresh pod in one native call;
- ``backend``: ``EbpfBackend`` (apply, remove, check, show, render: any pod, any state).
"""

from __future__ import annotations

from .backend import EbpfBackend
from .entries import PodEntries, intent_entries, pod_entries, policy_core, refuse
from .fresh import last_steps, setup_fresh
from .tc import detach_all

__all__ = ["EbpfBackend", "PodEntries", "intent_entries", "pod_entries", "policy_core", "refuse", "setup_fresh",
           "last_steps", "detach_all"]
