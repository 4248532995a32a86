"""The ambient node agent (``redirect-agent``) and its client side.

- ``redirect.agent.daemon``: the agent (events socket, node-proxy handoff, restart-safe reconcile,
  /healthz /readyz /metrics);
- ``redirect.agent.protocol``: the wire format of both sockets (docs/agent-protocol.md);
- ``redirect.agent.identity``: the pod identity the agent keeps in each pod's netns;
- ``redirect.agent.client``: what the CNI plugin calls (``add_pod``, ``del_pod``).

Importing this package imports nothing else: the CNI plugin loads only ``client``.
"""
