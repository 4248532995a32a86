"""A bpffs root of a test's own (``REDIRECT_BPF_ROOT``), its host pins removed after it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from redirect.backends import ebpf


@contextlib.contextmanager
def scratch_root(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[str]:
    """``/sys/fs/bpf/rdrt-<name>-<pid>`` as the eBPF backend's root while inside (the first setup
    compiles and pins there); afterwards nothing of it is left, or the test fails saying so."""
    root = f"/sys/fs/bpf/rdrt-{name}-{os.getpid()}"
    monkeypatch.setenv("REDIRECT_BPF_ROOT", root)
    try:
        yield root
    finally:
        ebpf.force_unload_host(root)
        assert not os.path.exists(root), f"left pins under {root}"
