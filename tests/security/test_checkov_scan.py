"""The checkov gate of ``make scan``: findings are matched to the documented exceptions, new ones and stale
exceptions fail it, and the docs table is the exceptions file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.security.checkov_scan import (
    DOCS_FILE,
    Accepted,
    Finding,
    docs_with_table,
    findings,
    judge,
    load_exceptions,
    object_ids,
    run_checkov,
)
from tests.security.renders import REPO

CHECKOV = REPO / ".tools" / "checkov" / "bin" / "checkov"

DEPLOYMENT = {"kind": "Deployment", "metadata": {"name": "web", "namespace": "llm"}, "spec": {"template": {}}}
WEB_PREFIX = {"kind": "Deployment", "metadata": {"name": "web-api", "namespace": "llm"}, "spec": {"template": {}}}
SERVICE = {"kind": "Service", "metadata": {"name": "web"}}


def failed(check: str, resource: str, title: str = "t") -> dict[str, Any]:
    return {"check_id": check, "check_name": title, "resource": resource}


def test_resources_resolve_to_the_scanned_objects() -> None:
    ids = object_ids([DEPLOYMENT, WEB_PREFIX, SERVICE])
    report = {
        "results": {
            "failed_checks": [
                failed("A", "Deployment.llm.web"),
                failed("B", "Service.default.web"),
                # A graph check names the workload's pod, labels appended.
                failed("C", "Pod.llm.web-api.app.kubernetes.io/name-web"),
                failed("A", "Deployment.llm.web"),  # the same object in two renders counts once
            ]
        }
    }
    assert findings(report, ids) == {
        Finding("A", "t", "Deployment", "web"),
        Finding("B", "t", "Service", "web"),
        Finding("C", "t", "Deployment", "web-api"),
    }
    with pytest.raises(ValueError, match="none of the scanned objects"):
        findings({"results": {"failed_checks": [failed("A", "Deployment.llm.other")]}}, ids)


def test_new_findings_and_stale_exceptions_fail() -> None:
    web, api = Finding("CKV_1", "t", "Deployment", "web"), Finding("CKV_2", "t", "Deployment", "api")
    everywhere = Accepted("CKV_1", "t", ("*",), "every workload", "r")
    only_web = Accepted("CKV_2", "t", ("Deployment/web",), "web", "r")
    verdict = judge({web, api}, [everywhere, only_web])
    assert verdict.accepted == [web] and verdict.new == [api]
    assert verdict.stale == ["CKV_2 Deployment/web"]
    assert not verdict.clean
    assert judge({web}, [everywhere]).clean
    # "*" still belongs to one check.
    assert judge({api}, [everywhere]).new == [api]


def test_exception_entries_need_every_field(tmp_path: Path) -> None:
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump([{"check": "CKV_1", "objects": ["*"]}]))
    with pytest.raises(ValueError, match=r"CKV_1.*missing applies, reason, title"):
        load_exceptions(path)


def test_the_docs_list_exactly_the_exceptions() -> None:
    text = DOCS_FILE.read_text()
    assert docs_with_table(text, load_exceptions()) == text, (
        "docs/operations.md is stale: python -m tests.security.checkov_scan --write-docs"
    )
    for entry in load_exceptions():
        assert entry.reason and entry.applies, entry.check


@pytest.mark.tools
def test_real_checkov_finds_what_the_exceptions_do_not_cover(tmp_path: Path) -> None:
    """A privileged pod in a serving namespace is a new finding, though a pool agent's is accepted."""
    if not CHECKOV.exists():
        pytest.skip("checkov is installed by `make scan` (its own virtual environment in .tools/checkov)")
    pod = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "rogue", "namespace": "llm"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "x:1", "securityContext": {"privileged": True}}]},
            },
        },
    }
    (tmp_path / "rogue.yaml").write_text(yaml.safe_dump(pod))
    found = findings(run_checkov(CHECKOV, tmp_path), object_ids([pod]))
    verdict = judge(found, load_exceptions())
    assert Finding("CKV_K8S_16", "Container should not be privileged", "Deployment", "rogue") in verdict.new
