"""Memory defaults: every container gets a limit; what the user set always wins."""

from __future__ import annotations

from maru_operator.builders.pool import build_agent_daemonset, build_metadata_deployment, memory_default
from maru_operator.builders.resources import ResourceDefault, with_defaults
from maru_operator.quantity import parse_quantity
from tests.support.specs import POOL_OWNER, container, dax_spec, pool_spec

DEFAULT = ResourceDefault(request=2**30, limit=4 * 2**30, cpu_millis=250)


def test_neither_given_sets_both() -> None:
    assert with_defaults({}, DEFAULT) == {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}


def test_a_user_limit_is_kept_and_nothing_added() -> None:
    given = {"limits": {"memory": "512Mi", "cpu": "2", "nvidia.com/gpu": 1}}
    assert with_defaults(given, DEFAULT) == given


def test_a_request_above_the_default_limit_becomes_the_limit() -> None:
    result = with_defaults({"requests": {"memory": "10Gi", "cpu": "2"}}, DEFAULT)
    assert result == {"requests": {"memory": "10Gi", "cpu": "2"}, "limits": {"memory": "10Gi"}}
    result = with_defaults({"requests": {"memory": "100Mi"}}, DEFAULT)
    assert result == {"requests": {"memory": "100Mi", "cpu": "250m"}, "limits": {"memory": "4Gi"}}


def test_cpu_limits_are_never_added() -> None:
    assert "cpu" not in with_defaults({"requests": {"cpu": "1"}}, DEFAULT)["limits"]


def test_the_shm_agent_holds_the_pool_in_its_memory() -> None:
    """Its memory-backed /dev/shm is charged to the container: a limit below the pool size would OOM-kill
    the agent as soon as it reserves the pool file."""
    ds = build_agent_daemonset(pool_spec(size="16Gi"), POOL_OWNER, "maru-system")
    resources = container(ds)["resources"]
    shm = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm")
    headroom = parse_quantity(resources["limits"]["memory"]) - parse_quantity(shm["emptyDir"]["sizeLimit"])
    assert headroom >= 256 * 2**20
    assert parse_quantity(resources["requests"]["memory"]) >= parse_quantity(shm["emptyDir"]["sizeLimit"])


def test_the_dax_agent_maps_device_memory_not_ram() -> None:
    assert memory_default(dax_spec(size="256Gi"), "agent") == memory_default(dax_spec(), "agent")
    resources = container(build_agent_daemonset(dax_spec(), POOL_OWNER, "maru-system"))["resources"]
    assert resources == {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}


def test_the_metadata_index_grows_with_the_pool() -> None:
    small, large = memory_default(dax_spec(size="64Gi"), "metadata"), memory_default(dax_spec(size="1Ti"), "metadata")
    assert small.limit < large.limit
    assert large.limit == 512 * 2**20 + 2**40 // 128
    unsized = container(build_metadata_deployment(dax_spec(), POOL_OWNER, "maru-system"))["resources"]  # type: ignore[arg-type]
    assert unsized["limits"] == {"memory": "4Gi"}


def test_user_resources_of_the_pool_daemons_win() -> None:
    spec = pool_spec(daemon={"resources": {"limits": {"memory": "20Gi"}, "requests": {"cpu": "1"}}})
    # With limits set, the memory request is the limit (what Kubernetes defaults it to anyway), and the
    # CPU limit the user left out is their CPU request: Guaranteed.
    assert container(build_agent_daemonset(spec, POOL_OWNER, "maru-system"))["resources"] == {
        "limits": {"cpu": "1", "memory": "20Gi"},
        "requests": {"cpu": "1", "memory": "20Gi"},
    }
