#!/usr/bin/env bash
# The machine's own programs that the local cluster and the image builds need: iproute2's `ip` (a network
# namespace and a veth per pod), buildah (the images, and the kubelet's image storage) and mmdebstrap (the
# Debian base image). The missing ones are installed with apt-get as root on Debian or Ubuntu; elsewhere
# this says what to install. `make demo` and CI (.ci/run) run it.
set -euo pipefail

missing=""
command -v ip >/dev/null 2>&1 || missing+=" iproute2"
command -v buildah >/dev/null 2>&1 || missing+=" buildah"
command -v mmdebstrap >/dev/null 2>&1 || missing+=" mmdebstrap"
[ -z "$missing" ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "host tools: installing$missing with apt-get"
    apt-get update -qq
    # shellcheck disable=SC2086 # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
else
    echo "host tools: missing$missing; install them (Debian or Ubuntu: sudo apt-get install -y$missing)" >&2
    exit 2
fi
