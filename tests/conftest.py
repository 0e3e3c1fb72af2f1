"""Every test gets one tier marker, from where it lives and what it starts:

* ``e2e``: the local cluster runs pods as a kubelet would (``tests/e2e``, ``tests/demo``, ``tests/localcluster``,
  and the image builds of ``tests/docker/test_built_images.py``);
* ``engines``: real vLLM engines (``tests/vllm``, ``tests/router``);
* ``integration``: real processes or servers short of those: the API server emulator, a kopf operator, pool
  daemons, the CSI plugin, helm and kubectl, vLLM's scheduler classes (``tests/operator``, ``tests/k8s``,
  ``tests/chart``, ``tests/security``, ``tests/pool``, ``tests/csi``, ``tests/connector``, ``tests/docker``), and
  any test elsewhere marked ``emulator``, ``tools`` or ``vllm``;
* ``unit``: the rest: pure functions, files, the package's own metadata.

``make test-fast`` runs ``-m unit``; ``make test`` runs every tier, on two pytest-xdist workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def folder_tier(relative: str) -> str | None:
    """The tier of a test file (``e2e/test_x.py``, relative to tests/) from where it lives; None: from its markers."""
    if relative in TIER_BY_FILE:
        return TIER_BY_FILE[relative]
    head, _, rest = relative.partition("/")
    return TIER_BY_FOLDER.get(head) if rest else None


def tier(item: pytest.Item) -> str:
    if name := folder_tier(Path(str(item.path)).resolve().relative_to(TESTS).as_posix()):
        return name
    if any(item.get_closest_marker(name) for name in HEAVY_MARKERS):
        return "integration"
    return "unit"


# Under pytest-xdist (``make test`` runs two workers) the tests of each of these tiers run on one worker, one
# after another: their engines and local clusters are module, package or session fixtures (the built images,
# the shared clusters), set up once, and these tiers side by side would share two cores between four engines.
# Every other module is a unit of work of its own, for whichever worker is free. The two tiers go first, one to
# each worker (the local-cluster tier, the longer, first), and the modules fill in behind them: a tier left for
# last runs alone on one worker while the other has nothing left to do.
SERIAL_TIERS = ("e2e", "engines")


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under pytest-xdist: its serial tier, or else its module."""
    module = nodeid.split("::", 1)[0]
    name = folder_tier(module.removeprefix("tests/"))
    return f"tier:{name}" if name in SERIAL_TIERS else module


def _run_order(item: pytest.Item) -> int:
    unit = work_unit(item.nodeid)
    return 0 if unit == "tier:e2e" else 1 if unit == "tier:engines" else 2


@pytest.hookimpl(optionalhook=True)  # the vLLM release environments run some of these tests without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        """xdist's per-scope scheduling with :func:`work_unit` as the scope, in collection order."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the order is _run_order's, not the units' sizes

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return TierScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier(item)))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, the scheduler follows
        items.sort(key=_run_order)
