"""Pytest fixtures: the local cluster's API server on loopback and simulated controllers.

Use them from a conftest.py::

    from tests.k8s.fixtures import k8s_emulator, kube_controllers  # noqa: F401

The classes live in the ``maru_localcluster`` package (see ``localcluster/README.md``), which the
demo uses too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from maru_localcluster.server import KubeEmulator, running_emulator
from maru_localcluster.simcontrollers import KubeControllers

__all__ = ["KubeControllers", "KubeEmulator", "k8s_emulator", "kube_controllers", "running_emulator"]


@pytest.fixture
def k8s_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeEmulator]:
    """A fresh emulator per test. Schema validation is on; see ``running_emulator`` to turn it off."""
    with running_emulator(tmp_path_factory.mktemp("k8s")) as handle:
        yield handle


@pytest.fixture
def kube_controllers(k8s_emulator: KubeEmulator) -> Iterator[KubeControllers]:
    """Simulated Deployment/DaemonSet controllers writing status into ``k8s_emulator``."""
    controllers = KubeControllers(k8s_emulator)
    with controllers:
        yield controllers
