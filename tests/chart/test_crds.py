"""The chart ships the same generated CRDs as the repository's top-level crds/ folder."""

from __future__ import annotations

from tests.support.chart import CHART, REPO_ROOT


def test_chart_crds_equal_top_level_crds_byte_for_byte() -> None:
    top = {p.name: p.read_bytes() for p in sorted((REPO_ROOT / "crds").glob("*"))}
    chart = {p.name: p.read_bytes() for p in sorted((CHART / "crds").glob("*"))}
    assert top, "no CRDs in crds/"
    assert sorted(chart) == sorted(top), "the chart's crds/ holds other files than crds/"
    for name, data in top.items():
        assert chart[name] == data, f"charts/maru-operator/crds/{name} differs from crds/{name}"
