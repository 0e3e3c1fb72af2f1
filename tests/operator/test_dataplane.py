"""An operator upgrade leaves running data planes alone until the user opts in.

The upgrade is played as it happens: an operator whose default images carry one tag creates the children,
stops, and an operator whose defaults carry the next tag takes over the same cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.dataplane import UPDATES_ANNOTATION, pinned, repository, updates_of
from maru_operator.images import ImageDefaults
from tests.support.operator import GROUP_NS, POOL_NS, RunningOperator, StubStats, group, has_condition, pool, settle

DEPLOY = "deployments.apps"
OLD, NEW = ImageDefaults(tag="1.0.0"), ImageDefaults(tag="1.1.0")


def test_repository_drops_the_tag_or_digest_only() -> None:
    assert repository("ghcr.io/maru-pd/maru-pool:1.0") == "ghcr.io/maru-pd/maru-pool"
    assert repository("localhost:5000/maru-pool@sha256:ab") == "localhost:5000/maru-pool"
    assert repository("localhost:5000/maru-pool") == "localhost:5000/maru-pool"


def test_a_running_default_is_held_unless_updates_are_auto() -> None:
    running = {"pool": OLD.pool_image, "vllm": OLD.vllm_image, "router": OLD.router_image}
    held = pinned(NEW, running, "manual")
    assert (held.pool_image, held.vllm_image) == (OLD.pool_image, OLD.vllm_image)
    assert pinned(NEW, running, "auto") == NEW
    # Nothing running yet, or another repository (a moved registry: the user's own change), takes the default.
    assert pinned(NEW, {}, "manual") == NEW
    moved = ImageDefaults(registry="mirror.example.com/maru", tag="1.1.0")
    assert pinned(moved, running, "manual") == moved


def test_the_object_annotation_overrides_the_fleet() -> None:
    assert updates_of({"annotations": {UPDATES_ANNOTATION: "auto"}}, "manual") == "auto"
    assert updates_of({"annotations": {UPDATES_ANNOTATION: "manual"}}, "auto") == "manual"
    assert updates_of({"annotations": {UPDATES_ANNOTATION: "sometimes"}}, "manual") == "manual"
    assert updates_of({}, "auto") == "auto"


def images(obj: dict[str, Any]) -> set[str]:
    spec = obj["spec"]["template"]["spec"]
    return {c["image"] for c in [*spec.get("initContainers", []), *spec["containers"]]}


def data_plane(cluster: KubeEmulator) -> dict[str, tuple[set[str], int]]:
    """Each pool and group child running a default image: (its images, its generation)."""
    out = {}
    for resource, ns in (("daemonsets.apps", POOL_NS), (DEPLOY, GROUP_NS)):
        for obj in cluster.list(resource, ns):
            out[f"{resource}/{obj['metadata']['name']}"] = (images(obj), obj["metadata"]["generation"])
    return out


@pytest.fixture
def upgraded(cluster: KubeEmulator, stats: StubStats) -> Iterator[tuple[dict[str, tuple[set[str], int]], Any]]:
    """A pool and a group made by the OLD operator, then the NEW operator running over them."""
    old = RunningOperator(cluster, stats, resync_seconds=3600, workers=4, images=OLD).start()
    try:
        cluster.create(pool())
        cluster.create(group())
        cluster.wait_for("inferencegroups.maru.io", "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    finally:
        old.stop()
    before = data_plane(cluster)
    new = RunningOperator(cluster, stats, resync_seconds=3600, workers=4, images=NEW).start()
    try:
        settle(new)
        yield before, new
    finally:
        new.stop()


@pytest.mark.emulator
def test_an_upgrade_leaves_every_data_plane_child_untouched(
    cluster: KubeEmulator,
    upgraded: tuple[dict[str, tuple[set[str], int]], Any],
) -> None:
    before, _ = upgraded
    assert before["daemonsets.apps/local-shm-agent"][0] == {OLD.pool_image}
    assert OLD.vllm_image in before[f"{DEPLOY}/qwen-prefill"][0]
    assert data_plane(cluster) == before  # same images, and no write changed a spec (same generations)


@pytest.mark.emulator
def test_an_object_opted_in_moves_and_the_others_stay(
    cluster: KubeEmulator,
    upgraded: tuple[dict[str, tuple[set[str], int]], Any],
) -> None:
    before, new = upgraded
    cluster.patch(
        "inferencegroups.maru.io", "qwen", {"metadata": {"annotations": {UPDATES_ANNOTATION: "auto"}}}, GROUP_NS
    )
    for role in ("prefill", "decode"):
        cluster.wait_for(DEPLOY, f"qwen-{role}", GROUP_NS, lambda o: NEW.vllm_image in images(o))
    settle(new)
    assert data_plane(cluster)["daemonsets.apps/local-shm-agent"] == before["daemonsets.apps/local-shm-agent"]
    cluster.patch("marupools.maru.io", "local-shm", {"metadata": {"annotations": {UPDATES_ANNOTATION: "auto"}}})
    cluster.wait_for("daemonsets.apps", "local-shm-agent", POOL_NS, lambda o: images(o) == {NEW.pool_image})
