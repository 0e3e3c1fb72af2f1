"""Per-group pool quotas: the spec fields, the quota the operator signs into a group's token, and the group's
usage in its status (from the daemons' /status the pool's reconcile polls anyway)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from maru_contracts import tenancy
from maru_operator.api.inferencegroup import InferenceGroupStatus, PoolUsage
from maru_operator.builders.credentials import effective_quota
from maru_operator.builders.group import PoolView
from maru_operator.status import group_usage_only_change, tenant_usage
from tests.support.specs import GROUP_OWNER, group_spec, minted_token, pool_spec

KEY = os.urandom(32)
Gi = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def token(group_fields: dict, pool_fields: dict) -> str:
    """The token the node plugin mints for the group's pods, under the pool's policy."""
    return minted_token(
        group_spec(**group_fields), GROUP_OWNER, PoolView(name="pool", spec=pool_spec(**pool_fields)), KEY
    )


class TestSpecFields:
    def test_quantities_in_the_pool_size_grammar_and_bounded_counts(self) -> None:
        spec = group_spec(poolQuota={"bytes": "16Gi", "pins": 4096, "leases": 1024})
        assert spec.pool_quota is not None and spec.pool_quota.bytes == "16Gi"
        for bad in ({}, {"bytes": "1.5Gi"}, {"bytes": "0"}, {"pins": 0}, {"leases": (1 << 20) + 1}, {"cpu": 1}):
            with pytest.raises(ValidationError):
                group_spec(poolQuota=bad)
        for bad in ({}, {"bytes": "16GB"}):
            with pytest.raises(ValidationError):
                pool_spec(tenantQuota=bad)

    def test_the_crds_carry_the_fields_with_descriptions_bounds_and_a_rule(self) -> None:
        ig = yaml.safe_load((REPO / "crds/maru.io_inferencegroups.yaml").read_text())
        schema = ig["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        quota = schema["spec"]["properties"]["poolQuota"]
        assert quota["description"] and quota["properties"]["pins"]["maximum"] == 1 << 20
        assert quota["properties"]["bytes"]["pattern"].startswith("^[1-9]")
        assert quota["x-kubernetes-validations"][0]["rule"] == "has(self.bytes) || has(self.pins) || has(self.leases)"
        assert "poolUsage" in schema["status"]["properties"]
        mp = yaml.safe_load((REPO / "crds/maru.io_marupools.yaml").read_text())
        pool = mp["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        assert {"tenantQuota", "maxTenantQuota"} <= set(pool)


class TestTokenCarriesTheQuota:
    def test_no_quota_anywhere_keeps_the_old_token(self) -> None:
        assert token({}, {}).startswith("maru1.")
        assert tenancy.verify(KEY, token({}, {})).quota == tenancy.DEFAULT_QUOTA

    def test_group_field_else_pool_default_capped_by_the_ceiling(self) -> None:
        got = tenancy.verify(
            KEY,
            token(
                {"poolQuota": {"bytes": "3Gi", "pins": 100}},
                {"tenantQuota": {"pins": 50, "leases": 64}, "maxTenantQuota": {"bytes": "2Gi"}},
            ),
        )
        assert got == tenancy.tenant("llm/llama")
        # pins: the group asked for 100, over the pool's default of 50 with no ceiling for pins: held to 50.
        assert got.quota == tenancy.Quota(bytes=2 * Gi, pins=50, leases=64)
        # A ceiling alone is also the default.
        assert effective_quota(None, pool_spec(maxTenantQuota={"leases": 8})) == tenancy.Quota(leases=8)

    def test_a_forged_quota_is_refused(self) -> None:
        version, body, _quota, mac = token({"poolQuota": {"bytes": "1Gi"}}, {}).split(".")
        forged = f"{version}.{body}.{base64.urlsafe_b64encode(b'bytes=4294967296').rstrip(b'=').decode()}.{mac}"
        with pytest.raises(tenancy.BadToken):
            tenancy.verify(KEY, forged)


def daemon_tenant(scope: str, used: int, **extra: object) -> dict:
    return {
        "tenant": scope,
        "used_bytes": used,
        "quota_bytes": 3 * Gi,
        "chunks": 2,
        "pins": 1,
        "leases": 0,
        "evictions_by_others": 0,
        "refused": {"bytes": 1, "pins": 2, "leases": 0},
        **extra,
    }


class TestUsageInStatus:
    def test_summed_over_a_shm_pools_nodes(self) -> None:
        usage = tenant_usage(
            {
                "node-1": {"tenants": [daemon_tenant("llm/llama", Gi)]},
                "node-2": {"tenants": [daemon_tenant("llm/llama", Gi), daemon_tenant("other/x", 5)]},
                "node-3": None,  # did not answer
            }
        )
        assert usage is not None
        mine = usage["llm/llama"]
        got = (mine.used, mine.used_bytes, mine.quota, mine.chunks, mine.quota_refusals)
        assert got == ("2Gi", 2 * Gi, "3Gi", 4, 6)
        assert tenant_usage({"node-1": None}) is None  # unknown, not zero

    def test_a_change_of_usage_alone_is_traffic(self) -> None:
        old = InferenceGroupStatus(pool_usage=PoolUsage(used_bytes=1))
        assert group_usage_only_change(old, old.model_copy(update={"pool_usage": PoolUsage(used_bytes=2)}))
        assert not group_usage_only_change(old, old.model_copy(update={"endpoint": "x"}))
        assert not group_usage_only_change(InferenceGroupStatus(), old)  # first known use: written at once
