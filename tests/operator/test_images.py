"""The images of MaruPools and InferenceGroups that name none: one registry flag moves all of them.

Unit tests of maru_operator.images and the flags, then the operator for real (kopf against the API
emulator), started with the flags the chart passes: a pool and a group without images get the
registry-prefixed images; an image an object names still wins.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_localcluster.server import KubeEmulator
from maru_operator import __version__
from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.cli import _parser, image_defaults
from maru_operator.images import DEFAULT_IMAGES, ImageDefaults, check_registry
from tests.support.operator import GROUP_NS, POOL_NS, RunningOperator, StubStats, group, has_condition, pool

REPO_ROOT = Path(__file__).resolve().parents[2]
APP_VERSION = yaml.safe_load((REPO_ROOT / "charts" / "maru-operator" / "Chart.yaml").read_text())["appVersion"]
MIRROR = "registry.example.com/mirror"


def test_the_default_tag_is_the_charts_app_version() -> None:
    assert __version__ == APP_VERSION
    assert DEFAULT_IMAGES.pool_image == f"ghcr.io/maru-pd/maru-pool:{APP_VERSION}"
    assert DEFAULT_IMAGES.vllm_image == f"ghcr.io/maru-pd/vllm-maru:{APP_VERSION}"
    assert DEFAULT_IMAGES.router_image == "ghcr.io/maru-pd/vllm-router:0.1.17"


def test_the_crds_name_each_default_image_without_a_registry_or_version() -> None:
    """The CRD text changes with the API, not with each release: it names the image, never its tag, so a
    version bump leaves the CRDs alone (and the API models need nothing from this module)."""
    from maru_operator.crdgen import rendered_files
    from maru_operator.images import DEFAULT_REGISTRY, POOL_NAME, ROUTER_NAME, ROUTER_VERSION, VLLM_NAME

    text = "".join(rendered_files().values())
    assert DEFAULT_REGISTRY not in text and ROUTER_VERSION not in text and f":{__version__}" not in text
    for name in (POOL_NAME, VLLM_NAME, ROUTER_NAME):
        assert f"<registry>/{name}:" in text, name


def test_one_registry_moves_every_default_and_a_whole_reference_wins() -> None:
    images = ImageDefaults(registry=MIRROR, tag="9.9.9", router="other.example.com/router:1")
    assert (images.pool_image, images.vllm_image, images.router_image) == (
        f"{MIRROR}/maru-pool:9.9.9",
        f"{MIRROR}/vllm-maru:9.9.9",
        "other.example.com/router:1",
    )


def test_an_image_the_object_names_wins() -> None:
    images = ImageDefaults(registry=MIRROR)
    mine = MaruPoolSpec.model_validate({"backend": "shm", "size": "1Gi", "daemon": {"image": "mine/pool:1"}})
    assert images.for_pool(mine).daemon.image == "mine/pool:1"
    unset = MaruPoolSpec.model_validate({"backend": "shm", "size": "1Gi"})
    assert unset.daemon.image is None
    assert images.for_pool(unset).daemon.image == f"{MIRROR}/maru-pool:{APP_VERSION}"
    spec = InferenceGroupSpec.model_validate({**group()["spec"], "router": {"image": "mine/router:2"}})
    resolved = images.for_group(spec)
    assert (resolved.image, resolved.router.image) == (f"{MIRROR}/vllm-maru:{APP_VERSION}", "mine/router:2")
    assert spec.image is None, "the object's spec is not changed"


def test_flags() -> None:
    args = _parser().parse_args(
        ["run", "--image-registry", MIRROR + "/", "--image-tag", "1.2.3", "--vllm-image", "mine/vllm:gpu"]
    )
    assert image_defaults(args) == ImageDefaults(registry=MIRROR, tag="1.2.3", vllm="mine/vllm:gpu")
    assert image_defaults(_parser().parse_args(["render", "-f", "x"])) == DEFAULT_IMAGES


@pytest.mark.parametrize(
    ("flag", "value", "rule"),
    [
        ("--image-registry", "https://registry.example.com", "no scheme"),
        ("--image-registry", "Registry.Example.com/Maru", "lower case"),
        ("--image-registry", "ghcr.io/maru-pd/maru-pool:0.1.0", "no tag"),
        ("--image-tag", "-bad", "is not an image tag"),
        ("--pool-image", "ghcr.io/x y", "is not an image reference"),
    ],
)
def test_a_bad_flag_names_itself_and_the_rule(
    flag: str, value: str, rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", f"{flag}={value}"])
    err = capsys.readouterr().err
    assert f"argument {flag}: {value!r}" in err and rule in err


def test_registry_with_a_port() -> None:
    assert check_registry("localhost:5000/") == "localhost:5000"


# --- the operator, for real -----------------------------------------------------------------------

DEPLOY = "deployments.apps"


@pytest.fixture
def mirrored_operator(cluster: KubeEmulator, stats: StubStats) -> Iterator[RunningOperator]:
    # What the chart's deployment passes with images.registry set (tests/chart/test_render.py checks that side).
    args = _parser().parse_args(["run", f"--image-registry={MIRROR}", f"--image-tag={APP_VERSION}"])
    running = RunningOperator(cluster, stats, resync_seconds=3600, workers=4, images=image_defaults(args)).start()
    try:
        yield running
    finally:
        running.stop()


def containers(obj: dict[str, Any]) -> dict[str, str]:
    spec = obj["spec"]["template"]["spec"]
    return {c["name"]: c["image"] for c in [*spec.get("initContainers", []), *spec["containers"]]}


@pytest.mark.emulator
def test_objects_without_images_get_the_registry_prefixed_ones(
    cluster: KubeEmulator,
    mirrored_operator: RunningOperator,
) -> None:
    cluster.create(pool())
    cluster.create(pool("own-image", daemon={"image": "pools.example.com/maru-pool:custom"}))
    cluster.wait_for("marupools.maru.io", "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
    stored = cluster.get("marupools.maru.io", "local-shm", None)
    assert "image" not in stored["spec"].get("daemon", {}), "the CRD writes no image default into the object"

    agent = cluster.wait_for("daemonsets.apps", "local-shm-agent", POOL_NS)
    assert set(containers(agent).values()) == {f"{MIRROR}/maru-pool:{APP_VERSION}"}
    for resource in (DEPLOY, "daemonsets.apps"):  # every pool daemon (an shm pool runs no metadata Deployment)
        for obj in cluster.list(resource, POOL_NS):
            if obj["metadata"]["name"].startswith("local-shm"):
                assert set(containers(obj).values()) == {f"{MIRROR}/maru-pool:{APP_VERSION}"}
    own = cluster.wait_for("daemonsets.apps", "own-image-agent", POOL_NS)
    assert set(containers(own).values()) == {"pools.example.com/maru-pool:custom"}

    cluster.create(group())
    for role in ("prefill", "decode"):
        dep = cluster.wait_for(DEPLOY, f"qwen-{role}", GROUP_NS)
        assert containers(dep)["vllm"] == f"{MIRROR}/vllm-maru:{APP_VERSION}"
    router = cluster.wait_for(DEPLOY, "qwen-router", GROUP_NS)
    # vllm-router, behind maru-router from the engines' image (decode-direct keys prompts with vLLM's hashing).
    assert containers(router) == {
        "router": f"{MIRROR}/vllm-maru:{APP_VERSION}",
        "vllm-router": f"{MIRROR}/vllm-router:0.1.17",
    }
