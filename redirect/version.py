"""The package version, written once: ``[project] version`` in ``pyproject.toml``.

An installed package reads it from its distribution's metadata (``importlib.metadata``); a source
tree (``pyproject.toml`` beside the package, as in an editable install) reads the file itself, so
the two never disagree. The thin CNI plugin has it compiled in by the package build (``setup.py``).
Asked lazily: a per-pod exec that does not print it does not pay for the lookup.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

#: What ``version()`` says when neither the metadata nor a ``pyproject.toml`` is there (a copied tree).
UNKNOWN = "0+unknown"


@functools.cache
def version() -> str:
    """The package version (``"0.1.0"``)."""
    tree = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        import tomllib

        with open(tree, "rb") as f:
            project = tomllib.load(f).get("project", {})
        if project.get("name") == "redirect" and isinstance(project.get("version"), str):
            return str(project["version"])
    except (OSError, ValueError):
        pass
    from importlib import metadata

    try:
        return metadata.version("redirect")
    except metadata.PackageNotFoundError:
        return UNKNOWN


class VersionAction(argparse.Action):
    """``--version``: print ``<prog> <version>`` and exit 0 (the version looked up only then)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        kw.setdefault("help", "print the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stdout.write(f"{parser.prog} {version()}\n")
        parser.exit(0)

