"""The ``redirect`` command line: ``main`` (setup, init, show, wait, inject, ...) with the
``node`` and ``ebpf`` subcommand groups."""
