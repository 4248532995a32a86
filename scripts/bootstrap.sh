#!/usr/bin/env bash
# Installs everything redirect needs on a fresh Debian 12 machine, idempotently:
# system packages, the kernel-header links bcc needs, bpffs, the venv, the native build.
# Safe to run again: each step checks before it acts. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${REDIRECT_VENV:-$ROOT/.venv}
log() { printf 'bootstrap: %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "must run as root (namespaces, netfilter, BPF)"; exit 1; }

PKGS=(iptables nftables python3-nftables bpfcc-tools python3-bpfcc libbpfcc-dev bpftool
      clang llvm linux-headers-amd64 ipset containernetworking-plugins containerd runc
      busybox-static conntrack iperf3 wrk iproute2 kmod python3-venv python3-dev
      libffi-dev gcc make procps psmisc squid)
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

# bcc compiles against /lib/modules/$(uname -r)/build; the running kernel has no
# header package, Debian's 6.1 headers serve for the networking programs.
KDIR=/lib/modules/$(uname -r)
if [ ! -e "$KDIR/build/include" ]; then
  arch=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1)
  if [ -n "$arch" ] && [ -n "$common" ]; then
    log "linking $KDIR/build -> $arch and source -> $common"
    mkdir -p "$KDIR"
    ln -sfn "$arch" "$KDIR/build"
    ln -sfn "$common" "$KDIR/source"
  else
    log "warning: no kernel headers under /usr/src; the eBPF backend will be unavailable"
  fi
fi

mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV on /usr/bin/python3"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
stamp="$VENV/.redirect-deps"
want=$(sha1sum requirements-dev.txt setup.py | sha1sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing Python packages into $VENV"
  # (pip's notes about unused local index locations on these machines are noise)
  "$VENV/bin/pip" install -q --disable-pip-version-check -r requirements-dev.txt 2> >(grep -v 'is ignored: it is neither' >&2)
  echo "$want" > "$stamp"
fi
# The native module: rebuilt whenever its sources (native/, redirect/bpf/abi.h) change (cheap, ~1 s).
# The editable install (console scripts: redirect, redirect-cni, redirect-agent, ...) is
# redone when setup.py changes, so a new entry point appears in an existing venv too.
so=$(ls redirect/_native*.so 2>/dev/null | head -n1 || true)
pkg_stamp="$VENV/.redirect-pkg"
pkg_want=$(sha1sum setup.py | cut -d' ' -f1)
if [ -z "$so" ] || [ -n "$(find native redirect/bpf/abi.h -newer "$so" -type f 2>/dev/null)" ] \
    || [ "$(cat "$pkg_stamp" 2>/dev/null)" != "$pkg_want" ]; then
  log "building native helpers (cffi)"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps -e . >/dev/null
  "$VENV/bin/python" native/build_native.py >/dev/null
  echo "$pkg_want" > "$pkg_stamp"
fi
# The thin CNI plugin (native/cni_thin.c): a static binary next to the package's code, where
# `redirect-cni install` takes it from; rebuilt when its source changes.
thin=redirect/cni/redirect-cni-thin
if [ ! -x "$thin" ] || [ native/cni_thin.c -nt "$thin" ]; then
  log "building the thin CNI plugin ($thin)"
  cflags=(-O2 -Wall -Wextra -Werror -o "$thin.tmp" native/cni_thin.c)
  gcc -static "${cflags[@]}" 2>/dev/null || gcc "${cflags[@]}"
  mv -f "$thin.tmp" "$thin"
fi
log "ready: $VENV"
