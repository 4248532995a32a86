"""The ``redirect-cni`` chained CNI plugin and its installer.

``redirect.cni.plugin`` is what the container runtime executes (``CNI_COMMAND`` set);
``redirect.cni.install`` puts it into a node's CNI configuration. This package
imports nothing on its own: the plugin is exec'd once per pod and must start fast.
"""
