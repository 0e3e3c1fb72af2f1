"""The chart fixtures (real helm binary, ``helm template``), shared with the chart tests."""

from tests.chart.conftest import helm, render, run_helm, template_args  # noqa: F401
