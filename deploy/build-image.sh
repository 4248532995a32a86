#!/usr/bin/env bash
# Builds the node image redirect:<version> (deploy/redirect-node.yaml's containers and the init
# container `redirect inject` writes) with Debian's own tools, and writes it as an OCI archive
# that `ctr images import`, `podman load` and `skopeo copy oci-archive:...` take:
#
#   make image                                   # = bash deploy/build-image.sh, as root
#   ctr -n k8s.io images import build/redirect-image.tar   # on each node (containerd)
#
# No container registry is needed: the base is made by mmdebstrap from this machine's apt
# sources (Debian 12, minbase, no recommends), the product goes in as the wheel of this tree
# (`pip wheel .`), its Python dependencies as wheels from the package index, and umoci makes
# the OCI image. Two layers:
#   1. Debian: python3, iptables, ipset, python3-nftables and python3-bpfcc (the eBPF backend),
#      and the venv /opt/redirect/venv (--system-site-packages, so Debian's nftables and bcc
#      bindings are seen) with the product's dependencies; cached under build/image/ by the
#      hash of this file, setup.py and pyproject.toml;
#   2. the redirect wheel installed into that venv (its console scripts on PATH).
# The archive is rebuilt only when what goes into it changed: build/redirect-image.tar.key holds
# the hash of this file and of the tree's files that make the wheel (redirect/, native/,
# setup.py, pyproject.toml, README.md), which are copied aside and built from there.
#
# Environment: REDIRECT_IMAGE_OUT (default build/redirect-image.tar), PYTHON (a Python with pip
# to build the wheel; default .venv/bin/python, else python3), APT_SOURCES (a sources file for
# mmdebstrap; default this machine's Debian sources).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf 'image: %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "must run as root (mmdebstrap --mode=root, chroot)"; exit 1; }
for tool in mmdebstrap umoci; do
  command -v "$tool" >/dev/null || { log "$tool not found: apt-get install mmdebstrap umoci (make bootstrap does)"; exit 1; }
done

OUT=${REDIRECT_IMAGE_OUT:-build/redirect-image.tar}
WORK=build/image
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
SUITE=bookworm
PACKAGES=python3,python3-pip-whl,python3-nftables,python3-bpfcc,iptables,ipset,mount
VENV=/opt/redirect/venv
# The image's pip, run from Debian's pip wheel with the venv's Python (the venv has no pip of its own).
PIP="set -- /usr/share/python-wheels/pip-*.whl; exec $VENV/bin/python \$1/pip"
IMAGE_PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mkdir -p "$WORK" "$(dirname "$OUT")"

# One build at a time (the test suite and `make image` may start together).
exec 9>"$WORK/.lock"
flock 9

# --- what goes into the image, hashed ----------------------------------------------------------
# The tree's files the wheel is made of: tracked or new, not ignored (never a build product of the
# tree: a stale native module, a plugin binary, setuptools' build/lib).
SOURCES=(redirect native setup.py pyproject.toml MANIFEST.in README.md)
wheel_inputs() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -co --exclude-standard -- "${SOURCES[@]}"
  else
    find "${SOURCES[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '_native*' ! -name '*.o' \
      ! -name 'redirect-cni-thin' 2>/dev/null
  fi | LC_ALL=C sort | while read -r f; do [ -f "$f" ] && printf '%s\n' "$f"; done
}
digest() { sha256sum "$@" | sha256sum | cut -c1-16; }
base_key=$(digest deploy/build-image.sh setup.py pyproject.toml)
mapfile -t inputs < <(wheel_inputs)
key="$base_key-$(digest "${inputs[@]}")"
if [ -f "$OUT" ] && [ "$(cat "$OUT.key" 2>/dev/null)" = "$key" ]; then
  log "$OUT is up to date ($key)"
  exit 0
fi
t0=$SECONDS

# --- the wheel of this tree, built from a clean copy of those files (as from an sdist) ---------
rm -rf "$WORK/wheel" "$WORK/src"
mkdir -p "$WORK/src"
log "building the wheel of this tree"
cp --parents -a "${inputs[@]}" "$WORK/src/"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WORK/wheel" "$WORK/src" \
  2> >(grep -v 'is ignored: it is neither' >&2)
rm -rf "$WORK/src"
wheel=$(ls "$WORK"/wheel/redirect-*.whl)
version=$(basename "$wheel" | cut -d- -f2)
NAME=redirect:$version

# --- layer 1: Debian and the venv with the dependencies (cached) -------------------------------
base=$WORK/base-$base_key
if [ ! -f "$base/done" ]; then
  rm -rf "$WORK"/base-* "$WORK/deps"
  log "fetching the Python dependencies' wheels"
  "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: -d "$WORK/deps" "$wheel" \
    2> >(grep -v 'is ignored: it is neither' >&2)
  rm -f "$WORK"/deps/redirect-*.whl
  sources=${APT_SOURCES:-}
  if [ -z "$sources" ]; then
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
      [ -s "$f" ] && { sources=$f; break; }
    done
  fi
  log "making the Debian $SUITE base with mmdebstrap (${sources:-deb.debian.org})"
  mkdir -p "$base"
  # path-exclude: no manuals, translations or docs (the copyright files stay).
  mmdebstrap --quiet --variant=minbase --mode=root \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --include="$PACKAGES" \
    --customize-hook="copy-in $WORK/deps /tmp" \
    --customize-hook="chroot \"\$1\" python3 -m venv --without-pip --system-site-packages $VENV" \
    --customize-hook="chroot \"\$1\" sh -c '$PIP install -q --disable-pip-version-check --no-index --no-cache-dir \
        /tmp/deps/*.whl'" \
    --customize-hook='rm -rf "$1"/tmp/deps "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*' \
    "$SUITE" "$base/rootfs" ${sources:+"$sources"} >"$WORK/mmdebstrap.log" 2>&1 \
    || { tail -n 30 "$WORK/mmdebstrap.log" >&2; log "mmdebstrap failed: see $WORK/mmdebstrap.log"; exit 1; }
  log "packing layer 1"
  tar --numeric-owner --xattrs -C "$base/rootfs" -cf "$base/layer.tar" .
  umoci init --layout "$base/oci"
  umoci new --image "$base/oci:base"
  umoci raw add-layer --image "$base/oci:base" --history.created_by "mmdebstrap $SUITE: $PACKAGES; $VENV" \
    "$base/layer.tar"
  rm -f "$base/layer.tar"
  touch "$base/done"
fi

# --- layer 2: the wheel, installed into the venv by the image's own pip ------------------------
top=$WORK/top
rm -rf "$top" && mkdir -p "$top"
log "installing $(basename "$wheel")"
unshare --mount --propagation private sh -euc '
  mount -t tmpfs tmpfs "$1/tmp"
  mkdir "$1/tmp/wheel" "$1/tmp/top"
  mount --bind "$2" "$1/tmp/wheel"
  mount --bind "$3" "$1/tmp/top"
  chroot "$1" sh -c "$4 install -q --disable-pip-version-check --no-index --no-deps --no-cache-dir \
      --no-warn-script-location --root /tmp/top /tmp/wheel/redirect-*.whl"
' sh "$base/rootfs" "$PWD/$WORK/wheel" "$PWD/$top" "$PIP"
tar --numeric-owner -C "$top" -cf "$WORK/top.tar" .

# --- the image -------------------------------------------------------------------------------
oci=$WORK/oci
rm -rf "$oci" && mkdir -p "$oci/blobs"
cp -al "$base/oci/blobs/sha256" "$oci/blobs/"   # layer 1's blobs are shared, never rewritten
cp "$base/oci/index.json" "$base/oci/oci-layout" "$oci/"
umoci raw add-layer --image "$oci:base" --tag "$version" --history.created_by "pip install $(basename "$wheel")" \
  "$WORK/top.tar"
umoci config --image "$oci:$version" --config.env "PATH=$IMAGE_PATH" --config.cmd redirect --config.cmd --help \
  --config.label "org.opencontainers.image.title=redirect" --config.label "org.opencontainers.image.version=$version" \
  --history.created_by "config: PATH, CMD redirect --help"
umoci rm --image "$oci:base"
umoci gc --layout "$oci"
# containerd names an imported image by io.containerd.image.name (the name a kubelet asks for,
# normalised as Kubernetes does: redirect:0.1.0 is docker.io/library/redirect:0.1.0); other
# tools read the tag in org.opencontainers.image.ref.name.
python3 - "$oci/index.json" "docker.io/library/$NAME" "$version" <<'EOF'
import json, sys
path, name, tag = sys.argv[1:]
index = json.load(open(path))
(manifest,) = index["manifests"]
manifest["annotations"] = {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}
with open(path, "w") as f:
    json.dump(index, f)
EOF
tar --numeric-owner -C "$oci" -cf "$OUT.tmp" oci-layout index.json blobs
mv -f "$OUT.tmp" "$OUT"
echo "$key" > "$OUT.key"
rm -rf "$top" "$WORK/top.tar" "$oci"
log "wrote $OUT ($NAME, $(du -m "$OUT" | cut -f1) MB, key $key) in $((SECONDS - t0)) s"
