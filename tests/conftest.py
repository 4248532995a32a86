"""Fixtures for the integration tests: pods, and a check that no namespace leaks."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import pytest

from redirect.backends.base import EBPF_DEFAULT_ROOT
from tests import netkit
from tests.netkit import Pod

# Tests that use any of these need root; without it the session stops at once.
ROOT_FIXTURES = {"pod", "pod_pair", "make_pod", "pod_with_extra_iface"}


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: `pytest -m noroot` runs without root
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    needing = [it.nodeid for it in items if ROOT_FIXTURES & set(getattr(it, "fixturenames", ()))]
    if needing:
        pytest.exit(
            f"{len(needing)} collected tests (e.g. {needing[0]}) create network namespaces and need root;"
            " run as root (e.g. `sudo make test`), or deselect them",
            returncode=4,
        )


@pytest.fixture
def make_pod() -> Iterator[Callable[..., Pod]]:
    """A factory: ``make_pod(extra_iface=False)`` returns a new Pod, removed after the test."""
    with ExitStack() as stack:

        def factory(**kw: Any) -> Pod:
            cm: AbstractContextManager[Pod] = netkit.make_pod(**kw)
            return stack.enter_context(cm)

        yield factory


@pytest.fixture
def test_node(tmp_path: Any) -> Iterator[Any]:
    """A node of the agent's tests (``tests.test_agent.Node``: its netns, sockets and run dir under
    ``tmp_path``), closed after the test."""
    from tests.test_agent import Node

    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def pod(make_pod: Callable[..., Pod]) -> Pod:
    return make_pod()


@pytest.fixture
def pod_with_extra_iface(make_pod: Callable[..., Pod]) -> Pod:
    return make_pod(extra_iface=True)


@pytest.fixture
def pod_pair(make_pod: Callable[..., Pod]) -> tuple[Pod, Pod]:
    return make_pod(), make_pod()


@pytest.fixture(scope="module")
def ebpf_root(request: pytest.FixtureRequest) -> Iterator[str]:
    """The eBPF backend's host programs under a scratch bpffs root of this test module, made the
    process's root (``$REDIRECT_BPF_ROOT``) while the module runs and removed at the end."""
    from redirect.backends import ebpf

    tag = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    root = f"/sys/fs/bpf/rdrt-{tag}-{os.getpid()}"
    old = os.environ.get("REDIRECT_BPF_ROOT")
    os.environ["REDIRECT_BPF_ROOT"] = root
    try:
        yield root
    finally:
        ebpf.force_unload_host(root)
        if old is None:
            os.environ.pop("REDIRECT_BPF_ROOT", None)
        else:
            os.environ["REDIRECT_BPF_ROOT"] = old
        assert not os.path.exists(root), f"left pins under {root}"


@pytest.fixture(autouse=True)
def _no_leaked_netns() -> Iterator[None]:
    """Fail the test that leaves a namespace this process created behind (and remove it)."""
    before = netkit.live_namespaces()
    yield
    leaked = netkit.live_namespaces() - before
    for name in sorted(leaked):
        netkit.remove_netns(name)
    if leaked:
        pytest.fail(f"test left network namespaces behind (now removed): {sorted(leaked)}", pytrace=False)


_DEFAULT_BPF_ROOT_THERE = os.path.exists(EBPF_DEFAULT_ROOT)


@pytest.fixture(autouse=True)
def _no_default_bpf_root() -> Iterator[None]:
    """Fail the test that loads the eBPF host programs at the default root (the node's own: a test
    takes a scratch root, ``ebpf_root``), and unload them: their cgroup links would capture every
    process of the machine from then on."""
    yield
    if not _DEFAULT_BPF_ROOT_THERE and os.path.exists(EBPF_DEFAULT_ROOT):
        from redirect.backends import ebpf

        ebpf.force_unload_host(EBPF_DEFAULT_ROOT)
        pytest.fail(f"test loaded the eBPF host programs at the default root {EBPF_DEFAULT_ROOT} (now removed);"
                    " use the ebpf_root fixture", pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove whatever this process still holds, and say so."""
    left = netkit.live_namespaces()
    for name in sorted(left):
        netkit.remove_netns(name)
    if left:
        print(f"\nnetkit: removed leftover namespaces at session end: {sorted(left)}", file=sys.stderr)
