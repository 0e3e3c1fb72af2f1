"""Is each CRD on the cluster the one this operator was built from?

Helm installs CRDs once and never upgrades them, so after a chart upgrade that changed the API the cluster can
keep the old CRDs (or, after a downgrade, newer ones). The API server then prunes fields this operator writes
and refuses ones it would accept, silently or far from the cause. At start the operator compares each CRD's
schema hash (an annotation ``make crds`` writes) with the one it generates itself, and says so where a user
looks: its log, a Warning Event on the CRD, and a metric an alert can match.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from maru_operator import metrics
from maru_operator.crdgen import KINDS, SCHEMA_HASH_ANNOTATION, build_crd, crd_name
from maru_operator.kube import ApiError, Kube, Unreachable

log = logging.getLogger("maru_operator.crdcheck")

CRDS_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
UPGRADE_COMMAND = "kubectl apply --server-side --force-conflicts -f charts/maru-operator/crds/"
STALE_REASON = "StaleCRD"


@dataclass(frozen=True)
class StaleCRD:
    name: str
    found: str | None  # the installed CRD's schema hash; None: it carries none (made before hashes were)
    expected: str
    installed: dict[str, Any]

    def message(self) -> str:
        found = f"schema hash {self.found}" if self.found else "no schema hash"
        return (
            f"the {self.name} CRD on the cluster ({found}) is not the one this operator was built from "
            f"(schema hash {self.expected}): the API server may drop or refuse fields the operator writes. "
            f"Apply the CRDs of this operator's chart version: {UPGRADE_COMMAND}"
        )


def stale_crds(installed: Iterable[dict[str, Any]]) -> list[StaleCRD]:
    """The operator's CRDs among ``installed`` whose schema differs from what this build generates."""
    by_name = {crd.get("metadata", {}).get("name"): crd for crd in installed}
    stale = []
    for kind in KINDS:
        crd = by_name.get(crd_name(kind))
        if crd is None:
            continue  # not installed at all: the preflight already stopped the operator
        expected = build_crd(kind)["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION]
        found = (crd.get("metadata", {}).get("annotations") or {}).get(SCHEMA_HASH_ANNOTATION)
        if found != expected:
            stale.append(StaleCRD(crd_name(kind), found, expected, crd))
    return stale


async def check_crds(kube: Kube) -> list[StaleCRD]:
    """Compare the installed CRDs with this build's; log, post a Warning Event on and count each stale one."""
    try:
        found = (
            await kube.request(
                "GET",
                CRDS_PATH,
                params={"labelSelector": "app.kubernetes.io/part-of=maru"},
                what="list the maru.io CRDs",
            )
            or {}
        )
    except (ApiError, Unreachable) as err:
        # Not knowing is no reason to stop serving; the chart grants the list, so say what is missing.
        log.warning(
            "could not compare the installed CRDs with this operator's (needs list on customresourcedefinitions): %s",
            err,
        )
        return []
    stale = stale_crds(found.get("items") or [])
    current = {s.name for s in stale}
    for kind in KINDS:
        metrics.CRD_STALE.labels(crd=crd_name(kind)).set(1 if crd_name(kind) in current else 0)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for crd in stale:
        log.error("stale CRD %s: %s", crd.name, crd.message(), extra={"crd": crd.name, "reason": STALE_REASON})
        involved = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", **crd.installed}
        await kube.event(involved, type_="Warning", reason=STALE_REASON, message=crd.message(), now=now)
    return stale
