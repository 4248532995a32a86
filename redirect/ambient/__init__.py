"""Ambient mode, node side: the node rules (``node``), the node agent (``agent``) that
enrols pods and hands their netns to the node proxy, and the node proxy (``nodeproxy``).
The in-pod rules themselves are a plan (``redirect.plan.ambient``)."""
