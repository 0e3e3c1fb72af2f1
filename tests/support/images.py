"""The product's images, built once per test session and shared by every test that needs them.

``maru_localcluster.imagebuild`` builds the Dockerfile's four targets (vLLM's as its CPU variant) under a
test registry and tags each with the reference the chart and the operator render, which is what the local
cluster looks up in the image storage. A cold build takes about four minutes on 2 cores (the vLLM CPU
image three of them), a rerun on the same machine seconds (buildah's layer cache). Each test module's
fixture calls :func:`build`; the first call builds, the others get the same result. Every user of the
images is in the local-cluster tier, which runs on one worker (tests/conftest.py).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from maru_localcluster import imagebuild
from maru_localcluster.imagebuild import BASE, CA_BUNDLE, TARGETS, Built, product_references
from maru_localcluster.tools import REPO_ROOT
from tests.required import require_root, require_tool

__all__ = ["BASE", "CA_BUNDLE", "REGISTRY", "REPO_ROOT", "TARGETS", "Built", "build", "product_references", "run"]

REGISTRY = "localhost/maru-test"

_built: Built | None = None
_base: str | None = None


def run(*command: str, timeout: float = 1200) -> str:
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (
        f"{' '.join(command)}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    return done.stdout


def base() -> str:
    """The Debian base image (a shell, coreutils, Python 3.11), bootstrapped once per session: the image
    the local cluster's own tests run their shells and scripts from."""
    global _base
    __tracebackhide__ = True
    require_root("building images with buildah")
    require_tool("buildah", "building images")
    require_tool("mmdebstrap", "bootstrapping the Debian base image")
    if _base is None:
        try:
            _base = imagebuild.build_base()
        except imagebuild.BuildFailed as err:
            pytest.fail(str(err), pytrace=False)
    return _base


def build(tmp_path_factory: pytest.TempPathFactory | None = None) -> Built:
    """The images of this session (built on the first call; the SBOMs under pytest's temporary folders)."""
    global _built
    __tracebackhide__ = True
    require_root("building images with buildah")
    require_tool("buildah", "building images")
    require_tool("mmdebstrap", "bootstrapping the Debian base image")
    if _built is not None:
        return _built
    workdir = tmp_path_factory.mktemp("images") if tmp_path_factory else Path(tempfile.mkdtemp(prefix="maru-images-"))
    try:
        _built = imagebuild.build(REGISTRY, workdir, sbom_dir=workdir / "sbom")
    except imagebuild.BuildFailed as err:
        pytest.fail(str(err), pytrace=False)
    return _built


def retag(targets: set[str], tag: str) -> list[str]:
    """The session's images of ``targets`` also under ``tag`` (what a newer release would publish); the new
    references, for :func:`untag`."""
    assert _built is not None, "build() first"
    refs = []
    for target in sorted(targets):
        ref = _built.product[target].rsplit(":", 1)[0] + f":{tag}"
        run("buildah", "tag", _built.product[target], ref)
        refs.append(ref)
    return refs


def untag(refs: list[str]) -> None:
    for ref in refs:
        run("buildah", "rmi", ref)
