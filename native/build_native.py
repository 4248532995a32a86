"""cffi build script for ``redirect._native`` (API mode, out of line).

``setup.py`` runs this through ``cffi_modules``; ``python native/build_native.py``
builds it in place for development.
"""

from __future__ import annotations

import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef(
    """
    int rdr_setns(int fd, int nstype);
    int rdr_sock_netns_cookie(int sockfd, uint64_t *cookie);
    int rdr_netns_cookie(int netns_fd, uint64_t *cookie);
    """
)
ffibuilder.set_source(
    "redirect._native",
    '#include "redirect_native.h"',
    sources=[str(HERE / "redirect_native.c")],
    include_dirs=[str(HERE)],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose=True)
