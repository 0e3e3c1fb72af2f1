"""The vLLM versions the connector is written and tested against, checked when vLLM imports it.

Importing this module checks the running vLLM (the connector package imports it before anything of vLLM).

The connector implements ``KVConnectorBase_V1`` as vLLM 0.32, 0.33 and 0.34 declare it (one class for the
three: the hooks 0.33 and 0.34 add are implemented, and 0.32 never calls them) and leans on their schedulers'
behaviour (asynchronous scheduling, block hashes, the load-failure policy, the capped hit). Another release
may import cleanly and then misbehave at run time, so the engine is refused at start with one clear error
instead. This range is the only place the supported releases are declared; tests run vLLM's real
``Scheduler`` with the connector under each minor release of it (``make vllm-venvs``).
``MARU_ALLOW_UNSUPPORTED_VLLM=1`` lets it start anyway, for trying a new release, with a loud warning.
"""

from __future__ import annotations

import logging
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# Pins (the Dockerfile's VLLM_IMAGE, pyproject's `vllm` and `vllm-gpu` extras) must lie inside it, the README
# names it, and tests/vllm-versions.txt lists one release of each minor version in it (tests check all three).
SUPPORTED_VLLM = ">=0.32,<0.35"
ALLOW_ENV = "MARU_ALLOW_UNSUPPORTED_VLLM"

log = logging.getLogger("maru_connector")


class UnsupportedVllmVersion(RuntimeError):
    """The running vLLM is not one the connector supports."""


def is_supported(version: str) -> bool:
    """Whether ``version`` (as ``vllm.__version__`` reports it, e.g. ``0.32.0+cpu``) is supported.

    The local label (``+cpu``, ``+cu129``, a git hash) is ignored; development builds of a supported
    release count as that release.
    """
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return SpecifierSet(SUPPORTED_VLLM).contains(parsed, prereleases=True)


def require_supported_vllm(version: str | None = None) -> None:
    """Raise :class:`UnsupportedVllmVersion` unless the running vLLM (or ``version``) is supported,
    or ``MARU_ALLOW_UNSUPPORTED_VLLM=1`` says to go on anyway."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    if is_supported(version):
        return
    message = (
        f"maru connector: vLLM {version} is not supported; the connector supports vLLM {SUPPORTED_VLLM} "
        f"(install that release, or set {ALLOW_ENV}=1 to start anyway at your own risk)"
    )
    if os.environ.get(ALLOW_ENV) == "1":
        log.warning(
            "%s. %s=1 is set: starting anyway; KV transfer may fail or corrupt output on this release",
            message,
            ALLOW_ENV,
        )
        return
    raise UnsupportedVllmVersion(message)


require_supported_vllm()
