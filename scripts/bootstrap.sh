#!/usr/bin/env bash
# Installs everything redirect needs on a fresh Debian 12 machine, idempotently:
# system packages, bpffs, the venv, the native build.
# Safe to run again: each step checks before it acts. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${REDIRECT_VENV:-$ROOT/.venv}
log() { printf 'bootstrap: %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "must run as root (namespaces, netfilter, BPF)"; exit 1; }

PKGS=(iptables nftables python3-nftables bpfcc-tools python3-bpfcc libbpfcc-dev bpftool
      clang llvm ipset containernetworking-plugins containerd runc
      busybox-static conntrack iperf3 wrk iproute2 kmod python3-venv python3-dev
      libffi-dev gcc make procps psmisc mmdebstrap umoci squid)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# No kernel headers: bcc compiles the eBPF programs against the UAPI headers the package
# carries (redirect/bpf/headers/), in a short-lived loader process.

mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV on /usr/bin/python3"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
stamp="$VENV/.redirect-deps"
want=$(sha1sum requirements-dev.txt | sha1sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing Python packages into $VENV"
  # (pip's notes about unused local index locations on these machines are noise)
  "$VENV/bin/pip" install -q --disable-pip-version-check -r requirements-dev.txt 2> >(grep -v 'is ignored: it is neither' >&2)
  echo "$want" > "$stamp"
fi
# The package build (setup.py's build_ext) makes the native parts: the cffi module redirect/_native
# and the thin CNI plugin redirect/cni/redirect-cni-thin, here in place through the editable install
# (which also puts the console scripts redirect, redirect-cni, redirect-agent, ... into the venv);
# `make wheel` runs the same build for a wheel. Redone when what it builds from changes.
pkg_stamp="$VENV/.redirect-pkg"
pkg_want=$(cat pyproject.toml setup.py MANIFEST.in native/* redirect/bpf/abi.h redirect/plan/lower_ebpf.py | sha1sum | cut -d' ' -f1)
so=$(ls redirect/_native*.so 2>/dev/null | head -n1 || true)
if [ -z "$so" ] || [ ! -x redirect/cni/redirect-cni-thin ] || [ "$(cat "$pkg_stamp" 2>/dev/null)" != "$pkg_want" ]; then
  log "building the package's native parts (cffi module, thin CNI plugin)"
  # (the module as older bootstraps built it, straight from native/build_native.py, would be
  # imported before this build's: _native.cpython-*.so comes before _native.abi3.so)
  rm -f redirect/_native.c redirect/_native.o redirect/_native.*.so
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation -e . 2> >(grep -v 'is ignored: it is neither' >&2) >/dev/null
  echo "$pkg_want" > "$pkg_stamp"
fi
log "ready: $VENV"
