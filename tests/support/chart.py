"""The chart as the real helm binary renders it: fixtures (a plugin of the root conftest) and what the chart and
security tests read back."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "maru-operator"
CUSTOM_VALUES = REPO_ROOT / "tests" / "chart" / "values-custom.yaml"
RELEASE = "maru-operator"
NAMESPACE = "maru-system"


@pytest.fixture(scope="session")
def helm() -> Path:
    # Imported here: the root conftest loads this plugin in every run, also where the test bed is not installed
    # (the scheduler tests under other vLLM releases).
    from maru_localcluster.tools import ToolUnavailable, helm_path

    try:
        return helm_path()
    except ToolUnavailable as err:
        pytest.skip(str(err))


Helm = Callable[..., subprocess.CompletedProcess[str]]
Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def run_helm(helm: Path) -> Helm:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60, check=False)

    return run


@pytest.fixture(scope="session")
def template_args() -> Callable[..., list[str]]:
    def args(*extra: str, release: str = RELEASE, namespace: str = NAMESPACE) -> list[str]:
        return ["template", release, str(CHART), "--namespace", namespace, *extra]

    return args


@pytest.fixture(scope="session")
def render(run_helm: Helm, template_args: Callable[..., list[str]]) -> Render:
    """``helm template`` the chart and return its objects; fails the test when helm refuses."""

    def render(*extra: str, **kwargs: str) -> list[dict[str, Any]]:
        import yaml

        result = run_helm(*template_args(*extra, **kwargs))
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return render


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]
