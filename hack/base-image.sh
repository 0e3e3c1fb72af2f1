#!/usr/bin/env bash
# Bootstrap a Debian bookworm Python 3.11 base image from Debian's own packages into buildah's local
# storage, for builders that cannot pull python:3.11-slim-bookworm (air-gapped, or behind a proxy with no
# registry mirror). `make base-image` runs it; `make images BASE=local` builds on it (docs/images.md).
#
#   BASE_IMAGE    name of the image                                   (default: localhost/maru-base:bookworm)
#   DEBIAN_MIRROR Debian archive the packages come from               (default: http://deb.debian.org/debian)
#   FORCE         1: rebuild even if an image of the same inputs exists
#
# The image holds Debian's python3, pip and ca-certificates (Debian's public CA list, as the python image
# does), `python` and `pip` on PATH, and no EXTERNALLY-MANAGED marker, so the Dockerfile's
# `pip install` lines run unchanged. It holds no compiler and none of this machine's files: a proxy's CA
# bundle reaches a build as a secret (hack/images.sh, CA_BUNDLE), never as a layer.
#
# Cached: the image carries a label with a hash of its inputs (this script, the mirror); a second run
# with the same inputs does nothing.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=${BASE_IMAGE:-localhost/maru-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
packages=python3,python3-pip,python-is-python3,ca-certificates,passwd

fail() {
    echo "make base-image: $*" >&2
    exit 2
}

for tool in buildah mmdebstrap; do
    command -v "$tool" >/dev/null 2>&1 || fail "$tool is not on PATH: install it (Debian: apt-get install -y buildah mmdebstrap)"
done

inputs=$( (cat "${BASH_SOURCE[0]}"; echo "$mirror") | sha256sum | cut -c1-16)
have=$(buildah inspect --type image --format '{{index .OCIv1.Config.Labels "io.maru.base.inputs"}}' "$name" 2>/dev/null || true)
if [ "$have" = "$inputs" ] && [ "${FORCE:-}" != 1 ]; then
    echo "make base-image: $name is up to date (inputs $inputs)"
    exit 0
fi

work=$(mktemp -d)
ctr=""
cleanup() {
    [ -n "$ctr" ] && buildah rm "$ctr" >/dev/null 2>&1
    rm -rf "$work"
}
trap cleanup EXIT

# Recommends stay out (python3-pip recommends the compiler); docs and man pages too. The customize hook
# runs outside the new root: it removes the marker that makes Debian's pip refuse system-wide installs
# (the Dockerfile installs into the image's one Python, like the python image) and apt's package lists.
echo "+ mmdebstrap bookworm ($packages) from $mirror"
mmdebstrap --variant=minbase --include="$packages" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED; rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    --components=main \
    bookworm "$work/rootfs.tar" \
    "deb $mirror bookworm main" \
    "deb $mirror bookworm-updates main" \
    "deb ${mirror%/debian}/debian-security bookworm-security main"

ctr=$(buildah from scratch)
buildah add "$ctr" "$work/rootfs.tar" / >/dev/null
buildah config --env LANG=C.UTF-8 --cmd python3 \
    --label "io.maru.base.inputs=$inputs" \
    --label "org.opencontainers.image.description=Debian bookworm, python3 and pip from Debian" "$ctr"
buildah commit --rm "$ctr" "$name" >/dev/null
ctr=""
echo "make base-image: built $name (inputs $inputs, $(buildah inspect --type image --format '{{.FromImageID}}' "$name" | cut -c1-12))"
