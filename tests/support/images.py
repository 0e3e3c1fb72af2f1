"""The product's images, built once per test session and shared by every test that needs them.

`make base-image` bootstraps the Debian base, `make images` builds the operator, pool and router targets
on it (the machine's CA bundle as the build secret, as docs/images.md tells air-gapped and proxied builders
to), under a test registry; then each is tagged with the reference the chart and the operator render
(``ghcr.io/maru-pd/maru-pool:<version>``), which is what the local cluster looks up in the image storage.
A cold build (base included) takes about 75 s on 2 cores, a rerun on the same machine seconds (buildah's
layer cache). Each test module's session fixture calls :func:`build`; the first call builds, the others
get the same result.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from maru_operator import __version__
from maru_operator.images import DEFAULT_REGISTRY, ImageDefaults
from tests.required import require_root, require_tool

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/maru-base:bookworm"
REGISTRY = "localhost/maru-test"
CA_BUNDLE = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
# Dockerfile target -> image name (hack/images.sh's names).
TARGETS = {"operator": "maru-operator", "pool": "maru-pool", "router": "vllm-router"}


def product_references() -> dict[str, str]:
    """Target -> the reference the chart (operator, CSI plugin) and the operator (pool, router) render."""
    defaults = ImageDefaults()
    return {
        "operator": f"{DEFAULT_REGISTRY}/{TARGETS['operator']}:{__version__}",
        "pool": defaults.pool_image,
        "router": defaults.router_image,
    }


@dataclass(frozen=True)
class Built:
    refs: dict[str, str]  # target -> the reference `make images` built it under
    product: dict[str, str]  # target -> the same image under the reference the chart and operator render
    sbom_dir: Path


_built: Built | None = None


def run(*command: str, timeout: float = 1200) -> str:
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (
        f"{' '.join(command)}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    return done.stdout


def build(tmp_path_factory: pytest.TempPathFactory | None = None) -> Built:
    """The images of this session (built on the first call; the SBOMs under pytest's temporary folders)."""
    global _built
    __tracebackhide__ = True
    require_root("building images with buildah")
    require_tool("buildah", "building images")
    require_tool("mmdebstrap", "bootstrapping the Debian base image")
    if _built is not None:
        return _built
    if not CA_BUNDLE.is_file():
        pytest.fail(f"{CA_BUNDLE}: no CA bundle to pass as the build secret")
    sbom_dir = tmp_path_factory.mktemp("sbom") if tmp_path_factory else Path(tempfile.mkdtemp(prefix="maru-sbom-"))
    run("make", "--no-print-directory", "base-image", f"BASE_IMAGE={BASE}")
    output = run(
        "make",
        "--no-print-directory",
        "images",
        f"TARGETS={' '.join(TARGETS)}",
        f"IMAGE_REGISTRY={REGISTRY}",
        f"PYTHON_IMAGE={BASE}",
        f"CA_BUNDLE={CA_BUNDLE}",
        f"SBOM_DIR={sbom_dir}",
    )
    # Its last line names what it built: "make images: built with buildah: REF REF REF".
    refs = dict(zip(TARGETS, output.strip().splitlines()[-1].split(": ")[-1].split(), strict=True))
    for target, name in TARGETS.items():
        assert refs[target].startswith(f"{REGISTRY}/{name}:"), refs
    product = product_references()
    for target, ref in refs.items():
        run("buildah", "tag", ref, product[target])
    _built = Built(refs, product, sbom_dir)
    return _built
