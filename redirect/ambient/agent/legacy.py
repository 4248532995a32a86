"""The in-pod record of earlier releases: found and removed, never read.

Earlier releases kept each pod's record inside the pod's own netns, as an ipset nobody matches
on (``rdr-pod-identity``, its entries' comments holding the record), and believed it after a
restart. A pod's root can write anything in its netns (with a user namespace of its own, any
pod), so such a set proves nothing: the agent's record is on the node (``store``). A set of that
name is only looked for, by its header (nothing of its content is read): in a netns the agent
has no record of, it is logged and left alone; in a pod's netns the agent enrols, adopts or
removes, it goes (with the ``del`` and the undo of a failed add, and in the plugin's own DEL).
"""

from __future__ import annotations

from ...kernel import netlink
from ...kernel import netns as _netns

SET = "rdr-pod-identity"
_SCRATCH = "rdr-pod-identity-new"


def _sets(netns: _netns.NetnsRef, destroy: bool) -> bool:
    """Whether ``netns`` has a set of that name (by its header: nothing of its content is read);
    with ``destroy``, it goes, and so does an earlier release's scratch copy."""
    with _netns.enter(netns):
        sock = netlink.NetlinkSocket(netlink.NETLINK_NETFILTER)  # a netlink socket stays in the netns it was made in
    try:
        found = False
        for name in (SET, _SCRATCH):
            if not netlink.ipset_exists(name, sock):
                continue
            found = found or name == SET
            if destroy:
                netlink.ipset_destroy(name, sock)
        return found
    finally:
        sock.close()


def exists(netns: _netns.NetnsRef) -> bool:
    """Whether ``netns`` has a set of that name."""
    return _sets(netns, destroy=False)


def clear(netns: _netns.NetnsRef) -> bool:
    """Remove the set from ``netns``; True if there was one."""
    return _sets(netns, destroy=True)


__all__ = ["SET", "exists", "clear"]
