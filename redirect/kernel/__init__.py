"""The kernel layer: entering network namespaces (``netns``), the per-netns lock
(``locks``), the hot path's netlink (``rtnl``), policy routes and local addresses
(``routes``), and scratch pods for the demo, tests and benchmarks (``podkit``)."""
