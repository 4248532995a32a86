"""Kubernetes: the sidecar injector (``redirect inject``) and the node manifests' command lines.

``redirect.k8s.inject`` rewrites pod specs offline; ``deploy/`` at the top of the source tree
holds the node DaemonSet (CNI installer and ambient node agent). Nothing here talks to an API
server.
"""
