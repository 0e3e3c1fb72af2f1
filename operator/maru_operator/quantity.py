"""Kubernetes quantities (``64Gi``, ``500m``, ``1e3``) to numbers and back, without a client library."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation, localcontext

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}


def parse_quantity(value: int | float | str) -> Decimal:
    """The value of a quantity; raises ValueError when it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    text = value.strip()
    try:
        with localcontext() as context:
            # Exact for every quantity Kubernetes accepts (the default 28 digits round 10000000000001Pi).
            context.prec = 80
            return _parse(text)
    except (InvalidOperation, IndexError):
        raise ValueError(f"not a quantity: {value!r}") from None


def _parse(text: str) -> Decimal:
    if text[-2:] in _BINARY:
        return Decimal(text[:-2]) * _BINARY[text[-2:]]
    # "E" alone is exa; "1E3" (an exponent) ends in a digit and never reaches this.
    if text[-1:] in _DECIMAL and not text[-1:].isdigit():
        return Decimal(text[:-1]) * _DECIMAL[text[-1:]]
    return Decimal(text)


def format_bytes(count: int) -> str:
    """Bytes as the largest binary unit that divides them exactly (``68719476736`` → ``64Gi``)."""
    if count <= 0:
        return "0"
    for suffix, factor in reversed(_BINARY.items()):
        if count % factor == 0:
            return f"{count // factor}{suffix}"
    return str(count)


def same_quantity(a: object, b: object) -> bool:
    """True when both are quantities of equal value (the API server rewrites ``1000m`` as ``1``)."""
    try:
        return parse_quantity(a) == parse_quantity(b)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return False
