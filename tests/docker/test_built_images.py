"""The operator, pool and router images, built for real by `make images` with buildah on the bootstrapped
Debian base (`make base-image`), the machine's CA bundle passed as the build secret, as docs/images.md
tells air-gapped and proxied builders to.

Each image's entrypoint starts as the image's own numeric user; no image has a compiler, and no layer the
build added holds the CA bundle or the secret's mount point; each has an SBOM. A Dockerfile copy with
planted defects (root user, a compiler, the bundle copied into a layer) shows the checks see them.

A cold build (base included) takes about 75 s on 2 cores; buildah's layer cache makes a rerun on the same
machine take seconds. The build runs once per session, shared with the local cluster's tests
(tests.support.images).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import imagecheck, images

REPO_ROOT = images.REPO_ROOT
BASE = images.BASE
REGISTRY = images.REGISTRY
CA_BUNDLE = images.CA_BUNDLE
IMAGES = images.TARGETS
# target -> the entrypoint's arguments that make it print its usage and exit 0
HELP = {"operator": ["--help"], "pool": ["--help"], "router": ["--help"], "vllm": ["--help"]}
SECRET_MOUNT = "--mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt"
run = images.run


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """target -> image reference, and the SBOM directory (the session's one build, tests.support.images)."""
    result = images.build(tmp_path_factory)
    return result.refs, result.sbom_dir


@pytest.mark.parametrize("target", list(IMAGES))
def test_entrypoint_starts_as_the_images_numeric_user(built: tuple[dict[str, str], Path], target: str) -> None:
    ref = built[0][target]
    assert imagecheck.user_problems(ref) == []
    entrypoint = imagecheck.config(ref)["Entrypoint"]
    done = imagecheck.run_as_user(ref, *entrypoint, *HELP[target])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "usage" in (done.stdout + done.stderr).lower()
    uid = imagecheck.run_as_user(ref, "id", "-u")
    assert uid.stdout.strip() == imagecheck.config(ref)["User"].split(":")[0]


@pytest.mark.parametrize("target", list(IMAGES))
def test_no_compiler_and_no_ca_bundle_in_any_layer(built: tuple[dict[str, str], Path], target: str) -> None:
    assert imagecheck.layer_problems(built[0][target], BASE, CA_BUNDLE.read_bytes()) == []


def test_each_image_has_an_sbom(built: tuple[dict[str, str], Path]) -> None:
    refs, sbom_dir = built
    for target, name in IMAGES.items():
        document = json.loads((sbom_dir / f"{name}.spdx.json").read_text())
        assert document["spdxVersion"] == "SPDX-2.3"
        assert document["name"] == refs[target]
        purls = {p["externalRefs"][0]["referenceLocator"].split("@")[0] for p in document["packages"]}
        assert {"pkg:deb/debian/python3.11", "pkg:pypi/maru-pd"} <= purls, target
        # gcc-12-base and libgcc-s1 (run-time support every Debian has) are not compilers.
        compilers = {f"pkg:deb/debian/{name}" for name in ("gcc", "gcc-12", "cpp", "cpp-12", "python3-dev")}
        assert not purls & compilers, target


def test_planted_defects_are_found(built: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    """The operator target, changed to run as root, with a compiler and with the CA bundle copied out of
    the secret into a layer: each check names its defect."""
    text = (REPO_ROOT / "Dockerfile").read_text()
    operator_user = "EXPOSE 8080 9090"
    assert text.count(operator_user) == 1
    planted = text.replace(
        operator_user,
        f"USER 0:0\nRUN {SECRET_MOUNT} cp /etc/ssl/certs/ca-certificates.crt /opt/ca.pem && cp /bin/true /usr/bin/gcc\n"
        + operator_user,
    )
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(planted)
    ref = f"{REGISTRY}/planted:defects"
    run(
        "buildah",
        "build",
        "--isolation",
        "chroot",
        "--layers",
        "--file",
        str(dockerfile),
        "--target",
        "operator",
        "--tag",
        ref,
        "--build-arg",
        f"PYTHON_IMAGE={BASE}",
        "--secret",
        f"id=ca-bundle,src={CA_BUNDLE}",
        ".",
    )
    try:
        assert imagecheck.user_problems(ref) == ["USER is 0:0: the image must name a numeric non-root UID:GID"]
        problems = imagecheck.layer_problems(ref, BASE, CA_BUNDLE.read_bytes())
        assert "usr/bin/gcc: a compiler in a runtime image" in problems
        assert "opt/ca.pem: a copy of the build's CA bundle" in problems
    finally:
        imagecheck.buildah("rmi", ref)
