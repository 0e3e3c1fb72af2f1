"""The release workflow builds and pushes every image the chart and the operator default to, tagged with the
chart's version, and publishes the chart; its version step refuses a tag that is not the chart's version.

The workflow's build step is `make images`, the command a user runs: the second half runs that exact
command line (from the workflow file) with a stand-in `docker` that records what it is asked to build, and
compares the images with the chart's and the operator's defaults.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_operator.images import DEFAULT_IMAGES
from tests.support.docker import builds, make_images, stages

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = REPO_ROOT / ".github" / "workflows" / "release.yml"
CHART = yaml.safe_load((REPO_ROOT / "charts" / "maru-operator" / "Chart.yaml").read_text())
# Build stages of the Dockerfile that are not images of their own.
INTERNAL_STAGES = {"wheel", "runtime", "project", "vllm-base-gpu", "vllm-base-cpu"}


@pytest.fixture(scope="module")
def workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text())


def step(job: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in job["steps"] if s.get("name") == name or s.get("id") == name)


def test_runs_on_version_tags_only(workflow: dict[str, Any]) -> None:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert on == {"push": {"tags": ["v*"]}}


def test_every_dockerfile_image_is_built_for_both_architectures_and_pushed(workflow: dict[str, Any]) -> None:
    targets = set(stages((REPO_ROOT / "Dockerfile").read_text())) - INTERNAL_STAGES
    job = workflow["jobs"]["images"]
    assert set(job["strategy"]["matrix"]["target"]) == targets == {"operator", "pool", "vllm", "router"}
    assert job["permissions"]["packages"] == "write"
    run = step(job, "build and push")["run"]
    assert " ".join(run.split()) == (
        "make images TARGETS=${{ matrix.target }} IMAGE_REGISTRY=${{ needs.version.outputs.registry }} "
        "IMAGE_TAG=${{ needs.version.outputs.version }} PLATFORMS=linux/amd64,linux/arm64 PUSH=1"
    )
    uses = [s.get("uses", "").split("@")[0] for s in job["steps"]]
    assert {"docker/setup-qemu-action", "docker/setup-buildx-action", "docker/login-action"} <= set(uses)


def test_the_chart_is_published_as_an_oci_artifact_after_the_images(workflow: dict[str, Any]) -> None:
    job = workflow["jobs"]["chart"]
    assert set(job["needs"]) == {"version", "images"}
    run = step(job, "package and push")["run"]
    assert 'helm package charts/maru-operator --version "$VERSION" --app-version "$VERSION"' in run
    assert 'helm push "dist/maru-operator-${VERSION}.tgz" "oci://${REGISTRY}/charts"' in run


def run_version_step(workflow: dict[str, Any], tmp_path: Path, tag: str) -> tuple[int, str, dict[str, str]]:
    """The version step's script in bash, as the runner runs it, with the variables GitHub sets."""
    bash = shutil.which("bash")
    assert bash
    output = tmp_path / "github_output"
    output.write_text("")
    done = subprocess.run(
        [bash, "-e", "-c", step(workflow["jobs"]["version"], "version")["run"]],
        cwd=REPO_ROOT,
        env={
            "PATH": os.environ["PATH"],
            "GITHUB_REF_NAME": tag,
            "GITHUB_OUTPUT": str(output),
            "GITHUB_REPOSITORY_OWNER": "Maru-PD",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines())
    return done.returncode, done.stdout + done.stderr, outputs


def test_the_tag_must_be_the_chart_version(workflow: dict[str, Any], tmp_path: Path) -> None:
    assert CHART["version"] == CHART["appVersion"]
    rc, output, outputs = run_version_step(workflow, tmp_path, f"v{CHART['version']}")
    assert rc == 0, output
    assert outputs == {"version": CHART["version"], "registry": "ghcr.io/maru-pd"}
    rc, output, outputs = run_version_step(workflow, tmp_path, "v9.9.9")
    assert rc != 0 and "must agree" in output and outputs == {}


def test_the_release_pushes_exactly_the_images_the_defaults_name(workflow: dict[str, Any], tmp_path: Path) -> None:
    """Run the workflow's own `make images` line for every target with a stand-in docker: the images it
    pushes are the chart's operator and CSI images and the operator's pool, vLLM and router defaults."""
    run = step(workflow["jobs"]["images"], "build and push")["run"]
    pushed = []
    for target in workflow["jobs"]["images"]["strategy"]["matrix"]["target"]:
        line = (
            run.replace("${{ matrix.target }}", target)
            .replace("${{ needs.version.outputs.registry }}", "ghcr.io/maru-pd")
            .replace("${{ needs.version.outputs.version }}", CHART["version"])
        )
        args = line.split()[2:]  # after `make images`
        (tmp_path / target).mkdir()
        rc, output, calls = make_images(tmp_path / target, ("docker",), *args)
        assert rc == 0, output
        (build,) = builds(calls)
        assert build[-2] == "--push" and "linux/amd64,linux/arm64" in build
        pushed.append(build[build.index("--tag") + 1])
    values = yaml.safe_load((REPO_ROOT / "charts" / "maru-operator" / "values.yaml").read_text())
    operator = f"{values['images']['registry']}/maru-operator:{CHART['appVersion']}"
    assert sorted(pushed) == sorted(
        [operator, DEFAULT_IMAGES.pool_image, DEFAULT_IMAGES.vllm_image, DEFAULT_IMAGES.router_image]
    )
    assert all(re.fullmatch(r"ghcr\.io/maru-pd/[a-z-]+:[0-9][0-9.]*", image) for image in pushed)
