"""Every test gets one tier marker, from where it lives and what it starts:

* ``e2e``: the local cluster runs pods as a kubelet would (``tests/e2e``, ``tests/demo``, ``tests/localcluster``,
  and the image builds of ``tests/docker/test_built_images.py``);
* ``engines``: real vLLM engines (``tests/vllm``, ``tests/router``);
* ``integration``: real processes or servers short of those: the API server emulator, a kopf operator, pool
  daemons, the CSI plugin, helm and kubectl, vLLM's scheduler classes (``tests/operator``, ``tests/k8s``,
  ``tests/chart``, ``tests/security``, ``tests/pool``, ``tests/csi``, ``tests/connector``, ``tests/docker``), and
  any test elsewhere marked ``emulator``, ``tools`` or ``vllm``;
* ``unit``: the rest: pure functions, files, the package's own metadata.

``make test-fast`` runs ``-m unit``; ``make test`` runs every tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Fixtures more than one folder uses.
pytest_plugins = ["tests.support.chart"]

TESTS = Path(__file__).resolve().parent
TIER_BY_FOLDER = {
    "e2e": "e2e",
    "demo": "e2e",
    "localcluster": "e2e",
    "vllm": "engines",
    "router": "engines",
    "operator": "integration",
    "k8s": "integration",
    "chart": "integration",
    "security": "integration",
    "pool": "integration",
    "csi": "integration",
    "connector": "integration",
    "docker": "integration",
}
# Files of pure functions in folders of the other tiers: builders, status, field ownership, the routing policy,
# key and index maths.
UNIT_FILES = (
    "connector/test_group_keys.py",
    "connector/test_hits.py",
    "connector/test_layout_reshard.py",
    "operator/test_builders_credentials.py",
    "operator/test_builders_group.py",
    "operator/test_builders_netpol.py",
    "operator/test_builders_pool.py",
    "operator/test_builders_poolevents.py",
    "operator/test_builders_resources.py",
    "operator/test_builders_router.py",
    "operator/test_disaggregation.py",
    "operator/test_names.py",
    "operator/test_ownership.py",
    "operator/test_quantity.py",
    "operator/test_quota.py",
    "operator/test_status.py",
    "operator/test_validation.py",
    "pool/test_allocator.py",
    "pool/test_index.py",
    "pool/test_units.py",
    "router/test_balance.py",
    "router/test_decide.py",
    "router/test_policy.py",
    "router/test_refresh.py",
    "router/test_revisions.py",
)
TIER_BY_FILE = {"docker/test_built_images.py": "e2e", **dict.fromkeys(UNIT_FILES, "unit")}
HEAVY_MARKERS = ("emulator", "tools", "vllm")


def tier(item: pytest.Item) -> str:
    relative = Path(str(item.path)).resolve().relative_to(TESTS)
    if relative.as_posix() in TIER_BY_FILE:
        return TIER_BY_FILE[relative.as_posix()]
    if len(relative.parts) > 1 and relative.parts[0] in TIER_BY_FOLDER:
        return TIER_BY_FOLDER[relative.parts[0]]
    if any(item.get_closest_marker(name) for name in HEAVY_MARKERS):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier(item)))
