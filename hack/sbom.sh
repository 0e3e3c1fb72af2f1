#!/usr/bin/env bash
# Write the SBOM of a built image: hack/sbom.sh BUILDER IMAGE OUT.json (hack/images.sh runs it after each
# build). The image's filesystem is read, not run: buildah and podman mount it, docker exports the few
# files hack/sbom.py reads (dpkg's status file and the Python distributions' METADATA).
set -euo pipefail

builder=$1 ref=$2 out=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$(dirname "$out")"

sbom() {
    python3 "$here/sbom.py" --root "$1" --name "$ref" --output "$out"
}

case "$builder" in
    buildah)
        ctr=$(buildah from --pull-never --quiet "$ref")
        trap 'buildah rm "$ctr" >/dev/null' EXIT
        sbom "$(buildah mount "$ctr")"
        ;;
    podman)
        trap 'podman image unmount "$ref" >/dev/null' EXIT
        sbom "$(podman image mount "$ref")"
        ;;
    docker)
        tmp=$(mktemp -d)
        id=$(docker create "$ref")
        trap 'docker rm "$id" >/dev/null; rm -rf "$tmp"' EXIT
        docker export "$id" | tar -x -C "$tmp" --wildcards 'var/lib/dpkg/status' '*.dist-info/METADATA' 2>/dev/null || true
        sbom "$tmp"
        ;;
    *)
        echo "hack/sbom.sh: unknown builder '$builder'" >&2
        exit 2
        ;;
esac
echo "sbom: $out"
