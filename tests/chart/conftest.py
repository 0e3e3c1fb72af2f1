"""Fixtures of the chart tests: the chart rendered with its defaults and with custom values (helm and the renderer
are tests.support.chart's fixtures)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.chart import CUSTOM_VALUES, Render


@pytest.fixture(scope="session")
def default_objects(render: Render) -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="session")
def custom_objects(render: Render) -> list[dict[str, Any]]:
    return render("--values", str(CUSTOM_VALUES))
