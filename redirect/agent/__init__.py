"""The ambient node agent (``redirect-agent``) and its client side.

- ``redirect.agent.daemon``: the agent: the enrolment transaction, restart-safe reconcile and
  resync, the node-proxy hand-off, the command line;
- ``redirect.agent.events``: the events socket's server (idle clients never hold a worker);
- ``redirect.agent.proxies``: one connected node proxy (ordered sends, validated acks);
- ``redirect.agent.discovery``: finding the pods' records after a restart, in the namespaces
  root made or pinned;
- ``redirect.agent.pods``: a pod's fields, validated once for events and for records;
- ``redirect.agent.identity``: the record the agent keeps in each pod's netns;
- ``redirect.agent.metrics``: /healthz /readyz /metrics and their bounded HTTP server;
- ``redirect.agent.protocol``: the wire format of both sockets (docs/agent-protocol.md);
- ``redirect.agent.client``: what the CNI plugin calls (``add_pod``, ``del_pod``).

Importing this package imports nothing else: the CNI plugin loads only ``client``.
"""
