from __future__ import annotations

from decimal import Decimal

import pytest

from maru_operator.quantity import parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("64Gi", 64 * 2**30),
        ("500m", Decimal("0.5")),
        ("1e3", 1000),
        ("1E3", 1000),
        ("2E", 2 * 10**18),
        ("3P", 3 * 10**15),
        ("1.5Ki", 1536),
        ("10000000000001Pi", 10000000000001 * 2**50),
    ],
)
def test_kubernetes_quantities(text: str, value: object) -> None:
    # "2E" is two exa; it was read as a broken exponent and refused.
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "E", "1Qi", "1e", "abc"])
def test_not_quantities(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)
