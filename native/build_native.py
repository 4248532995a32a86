"""cffi build script for ``redirect._native`` (API mode, out of line).

``setup.py`` runs this through ``cffi_modules``; ``python native/build_native.py``
builds it in place for development.
"""

from __future__ import annotations

import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent

ffibuilder = FFI()
# The declarations are the header's own (less its #include lines): one list to keep true.
ffibuilder.cdef("\n".join(line for line in (HERE / "redirect_native.h").read_text().splitlines()
                           if not line.startswith("#include")))
ffibuilder.set_source(
    "redirect._native",
    '#include "redirect_native.h"',
    sources=[str(HERE / "redirect_native.c"), str(HERE / "pod_setup.c"), str(HERE / "netfilter_probe.c")],
    include_dirs=[str(HERE)],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose=True)
