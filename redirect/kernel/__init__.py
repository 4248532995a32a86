"""The kernel layer: entering network namespaces (``netns``), the per-netns lock
(``locks``), the library's netlink client (``netlink``), policy routes and local addresses
(``routes``), and scratch pods for the demo, tests and benchmarks (``podkit``)."""
