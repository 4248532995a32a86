"""The renderings of every backend match the checked-in golden files (no root needed).

After an intended rule change: ``.venv/bin/python -m tests.golden --update``, then review the diff.
"""

from __future__ import annotations

import glob
import os

import pytest

from tests.golden import DIR, cases, path, rendered

pytestmark = pytest.mark.noroot


@pytest.mark.parametrize(("name", "backend"), cases(), ids=[f"{n}-{b}" for n, b in cases()])
def test_rendering_matches_golden(name: str, backend: str) -> None:
    text = rendered(name, backend)
    p = path(name, backend)
    if text is None:
        assert not os.path.exists(p), f"{backend} refuses {name} now, but {p} exists"
        return
    assert os.path.exists(p), f"no golden file {p}: run python -m tests.golden --update"
    with open(p, encoding="utf-8") as f:
        want = f.read()
    assert text == want, f"{name} on {backend} renders differently from {p}: run python -m tests.golden to list, " \
                         "--update to accept"


def test_every_golden_file_is_a_case() -> None:
    known = {path(n, b) for n, b in cases()}
    stale = sorted(set(glob.glob(os.path.join(DIR, "*.golden"))) - known)
    assert not stale, f"golden files without a case: {stale}"


def test_the_set_covers_both_modes_and_every_backend() -> None:
    files = [os.path.basename(p) for p in glob.glob(os.path.join(DIR, "*.golden"))]
    for backend in ("iptables", "nftables", "ebpf"):
        assert sum(f.endswith(f".{backend}.golden") for f in files) >= 10, backend
    assert any(f.startswith("ambient-") for f in files)
