"""The package build's native parts, which pyproject.toml (the metadata) cannot describe.

``build_ext`` compiles both, in a wheel build and in an editable install (in place) alike:

- ``redirect._native``, the cffi helpers (``native/build_native.py``, through ``cffi_modules``);
- ``redirect/cni/redirect-cni-thin``, the thin CNI plugin (``native/cni_thin.c``): an executable,
  linked statically when the C library allows it (it runs on the node, outside any venv or image),
  carrying the package version. ``redirect-cni install`` copies it into the node's CNI bin dir.

Before compiling it checks for what the build needs from the system, and names what is missing.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

THIN_SOURCE = os.path.join("native", "cni_thin.c")
#: Where the thin plugin goes, relative to the build's lib dir (or the source tree, in place).
THIN = os.path.join("redirect", "cni", "redirect-cni-thin")
THIN_CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror"]


def _compiler() -> list[str]:
    """The C compiler command, as for the cffi module: ``$CC``, else the one Python was built with."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def _missing(cc: list[str]) -> list[str]:
    """What the build needs from the system and does not find, each with its Debian package."""
    out = []
    if not shutil.which(cc[0]):
        out.append(f"a C compiler ({cc[0]}; Debian: gcc)")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        out.append(f"the Python headers ({include}/Python.h; Debian: python3-dev)")
    if not os.path.exists("/usr/include/linux/bpf.h") and shutil.which(cc[0]):
        probe = subprocess.run([*cc, "-E", "-x", "c", "-"], input=b"#include <linux/bpf.h>\n",
                               capture_output=True, check=False)
        if probe.returncode != 0:
            out.append("the C library's and the kernel's headers (<linux/bpf.h>; Debian: libc6-dev, linux-libc-dev)")
    return out


class BuildNative(build_ext):
    """``build_ext`` (the cffi module, which cffi adds) and then the thin CNI plugin."""

    def run(self) -> None:
        cc = _compiler()
        missing = _missing(cc)
        if missing:
            raise CompileError("building redirect needs " + "; ".join(missing) +
                               ". On Debian: apt-get install gcc python3-dev libc6-dev")
        super().run()
        self.build_thin(cc)

    def _thin_paths(self) -> tuple[str, str]:
        """(the thin plugin in the build's lib dir, its place in the source tree)."""
        return os.path.join(self.build_lib, THIN), THIN

    def build_thin(self, cc: list[str]) -> None:
        built, in_place = self._thin_paths()
        os.makedirs(os.path.dirname(built), exist_ok=True)
        version = self.distribution.get_version()
        tmp = built + ".tmp"
        argv = [*THIN_CFLAGS, f'-DREDIRECT_VERSION="{version}"', "-o", tmp, THIN_SOURCE]
        self.announce(f"building the thin CNI plugin: {shlex.join([*cc, '-static', *argv])}", level=2)
        if subprocess.run([*cc, "-static", *argv], capture_output=True, check=False).returncode != 0:
            self.warn("the thin CNI plugin: static linking failed (no static C library: Debian's libc6-dev has "
                      "it); linking it dynamically, so the node needs a compatible C library")
            r = subprocess.run([*cc, *argv], capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise CompileError(f"building the thin CNI plugin ({THIN_SOURCE}) failed:\n{r.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, built)
        if self.inplace:
            self.copy_file(built, in_place, level=self.verbose)

    def get_outputs(self) -> list[str]:
        if self.inplace:
            return super().get_outputs()
        return [*super().get_outputs(), self._thin_paths()[0]]

    def get_output_mapping(self) -> dict[str, str]:
        mapping = super().get_output_mapping()
        if self.inplace:
            built, in_place = self._thin_paths()
            mapping[built] = in_place
        return mapping


setup(
    cmdclass={"build_ext": BuildNative},
    cffi_modules=["native/build_native.py:ffibuilder"],
)
