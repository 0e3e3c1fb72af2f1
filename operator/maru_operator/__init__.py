"""Maru P/D operator: the control plane.

Layers: ``api`` (pydantic models of the CRDs, the single source of the schema), ``builders``
(pure functions from a spec to the desired child objects), ``handlers`` (thin kopf glue).
This package never imports vLLM or torch.
"""

__version__ = "0.1.0"
