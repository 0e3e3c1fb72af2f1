"""Spec errors as a user reads them: ``spec.<field>: <rule>``."""

from __future__ import annotations

from pydantic import ValidationError


def model_errors(err: ValidationError) -> list[str]:
    """The model's refusals as ``spec.<field>: <rule>`` lines."""
    return [".".join(["spec", *(str(p) for p in e["loc"])]) + f": {e['msg']}" for e in err.errors()]
