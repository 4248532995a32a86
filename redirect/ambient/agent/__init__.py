"""The ambient node agent (``redirect-agent``) and its client side (all below ``redirect.ambient.agent``).

- ``daemon``: the parts wired to the sockets, and the command line;
- ``enroller``: the enrolment transaction (``add``), ``del`` and ``check``;
- ``reconcile``: the start's read-back of the records and the repairs, and the resync while running;
- ``hub``: the node proxies: snapshots, pods handed out and taken back, acks;
- ``registry``: the pods held, and the lock that orders them against the proxies;
- ``ops``: what the agent changes in the kernel and its store (rules, records, node sets), in one place;
- ``dispatch``: what answers each message of the events socket;
- ``events``: the events socket's server (idle clients never hold a worker);
- ``proxies``: one connected node proxy (ordered sends, validated acks);
- ``discovery``: the pods' records read back after a restart, and each one's netns found;
- ``pods``: a pod's fields, validated once for events and for records;
- ``store``: the agent's record of each pod, on the node where only root writes (by netns inode and cookie);
- ``legacy``: an earlier release's record inside a pod's netns, found and removed, never read;
- ``metrics``: /healthz /readyz /metrics and their bounded HTTP server;
- ``warmup``: the default backend's warm-up, and whether it is usable yet (/readyz);
- ``cni_requests``: the thin CNI plugin's requests, served with the plugin's own code;
- ``protocol``: the wire format of both sockets (docs/agent-protocol.md);
- ``client``: what the CNI plugin calls (``add_pod``, ``del_pod``).

Importing this package imports nothing else: the CNI plugin loads only ``client``.
"""
