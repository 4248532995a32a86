"""The ambient node agent (``redirect-agent``) and its client side.

- ``redirect.ambient.agent.daemon``: the agent: the enrolment transaction, restart-safe reconcile and
  resync, the node-proxy hand-off, the command line;
- ``redirect.ambient.agent.events``: the events socket's server (idle clients never hold a worker);
- ``redirect.ambient.agent.proxies``: one connected node proxy (ordered sends, validated acks);
- ``redirect.ambient.agent.discovery``: finding the pods' records after a restart, in the namespaces
  root made or pinned;
- ``redirect.ambient.agent.pods``: a pod's fields, validated once for events and for records;
- ``redirect.ambient.agent.identity``: the record the agent keeps in each pod's netns;
- ``redirect.ambient.agent.metrics``: /healthz /readyz /metrics and their bounded HTTP server;
- ``redirect.ambient.agent.protocol``: the wire format of both sockets (docs/agent-protocol.md);
- ``redirect.ambient.agent.client``: what the CNI plugin calls (``add_pod``, ``del_pod``).

Importing this package imports nothing else: the CNI plugin loads only ``client``.
"""
