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
    int rdr_bpf_obj_pin(int fd, const char *path);
    int rdr_bpf_obj_get(const char *path);
    int rdr_bpf_link_create(int prog_fd, int target_fd, uint32_t attach_type, uint32_t flags);
    int rdr_bpf_link_detach(int link_fd);
    int rdr_bpf_map_update(int map_fd, const void *key, const void *value, uint64_t flags);
    int rdr_bpf_map_lookup(int map_fd, const void *key, void *value);
    int rdr_bpf_map_delete(int map_fd, const void *key);
    int rdr_bpf_map_next_key(int map_fd, const void *key, void *next_key);
    int rdr_bpf_prog_id(int prog_fd, uint32_t *id);
    int rdr_bpf_link_info(int link_fd, uint32_t *id, uint32_t *type, uint32_t *prog_id,
                          uint32_t *attach_type, uint64_t *target);
    int rdr_pidfd_getfd(int pidfd, int fd);
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
