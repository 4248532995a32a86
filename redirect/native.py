"""The compiled helpers, ``redirect._native``: the cffi module the package build makes from ``native/``
(``setup.py``). Everything that calls into them gets them from ``load()``, which says how to get them
when this copy of redirect has none (a source tree not built, files copied without it)."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import NotBuilt

NAME = f"{__package__}._native"
HOW = ("install redirect with pip (pip install . in the source tree, or its wheel; the build needs gcc, "
       "python3-dev and libc6-dev), or run `make bootstrap` in the source tree")


def load() -> Any:
    """``redirect._native`` (``.lib``, ``.ffi``); ``NotBuilt`` when it is missing or does not load."""
    try:
        return importlib.import_module(NAME)
    except ImportError as e:  # not built; or built for another Python, or its cffi missing
        what = "are missing" if isinstance(e, ModuleNotFoundError) and e.name == NAME else f"do not load ({e})"
        raise NotBuilt(f"redirect's compiled helpers ({NAME}) {what}: {HOW}") from None
