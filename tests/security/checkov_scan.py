"""checkov over everything the product deploys; fails on any finding that is not a documented exception.

    python -m tests.security.checkov_scan --checkov .tools/checkov/bin/checkov   # what `make scan` runs
    python -m tests.security.checkov_scan --write-docs                          # regenerate the docs table

Scanned: the chart rendered with its defaults, and ``maru-operator render`` of every example with the
example group bound to each example pool in turn (see ``renders.py``). checkov runs offline
(``--skip-download``) with its Kubernetes framework. Every failed check must match an entry of
``checkov-exceptions.yaml`` (check id, and the object or ``*``), and every entry must still match a
finding, so the list can neither hide a new problem nor outlive a fixed one. ``docs/operations.md``
carries the list as a table between markers, generated from the file (a test keeps it fresh).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.security.renders import REPO, chart_render, examples_bound_to_each_pool

EXCEPTIONS_FILE = Path(__file__).with_name("checkov-exceptions.yaml")
DOCS_FILE = REPO / "docs" / "operations.md"
DOCS_START = "<!-- checkov-exceptions:start -->"
DOCS_END = "<!-- checkov-exceptions:end -->"
EVERY = "*"


@dataclass(frozen=True, order=True)
class Finding:
    check: str
    title: str
    kind: str
    name: str

    @property
    def object(self) -> str:
        return f"{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"{self.check} {self.object}: {self.title}"


@dataclass(frozen=True)
class Accepted:
    check: str
    title: str
    objects: tuple[str, ...]
    applies: str
    reason: str

    def covers(self, finding: Finding) -> bool:
        return finding.check == self.check and (EVERY in self.objects or finding.object in self.objects)


def load_exceptions(path: Path = EXCEPTIONS_FILE) -> list[Accepted]:
    entries = yaml.safe_load(path.read_text()) or []
    result = []
    for i, entry in enumerate(entries):
        missing = {"check", "title", "objects", "applies", "reason"} - set(entry)
        if missing:
            raise ValueError(f"{path.name} entry {i} ({entry.get('check', '?')}): missing {', '.join(sorted(missing))}")
        result.append(
            Accepted(
                entry["check"],
                entry["title"],
                tuple(entry["objects"]),
                entry["applies"],
                " ".join(str(entry["reason"]).split()),
            )
        )
    return result


def object_ids(objects: Iterable[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """checkov's resource id (``Kind.namespace.name``) -> (kind, name) of every scanned object.

    checkov's graph checks report a workload's pod as ``Pod.<namespace>.<workload name>.<labels>``;
    those map back to the workload.
    """
    ids: dict[str, tuple[str, str]] = {}
    for obj in objects:
        meta = obj.get("metadata") or {}
        name, namespace = meta.get("name", ""), meta.get("namespace") or "default"
        ids[f"{obj['kind']}.{namespace}.{name}"] = (obj["kind"], name)
        if "template" in (obj.get("spec") or {}):
            ids.setdefault(f"Pod.{namespace}.{name}", (obj["kind"], name))
    return ids


def _resolve(resource: str, ids: dict[str, tuple[str, str]]) -> tuple[str, str]:
    if resource in ids:
        return ids[resource]
    # Longest prefix first: "Pod.ns.a-b.<labels>" must not resolve to a workload named "a".
    for known in sorted(ids, key=len, reverse=True):
        if resource.startswith(known + "."):
            return ids[known]
    raise ValueError(f"checkov reported {resource!r}, which is none of the scanned objects")


def findings(report: dict[str, Any] | list[dict[str, Any]], ids: dict[str, tuple[str, str]]) -> set[Finding]:
    """The failed checks of checkov's JSON report, one per check and object (renders repeat objects)."""
    reports = report if isinstance(report, list) else [report]
    out = set()
    for part in reports:
        for failed in (part.get("results") or {}).get("failed_checks") or []:
            kind, name = _resolve(failed["resource"], ids)
            out.add(Finding(failed["check_id"], failed["check_name"], kind, name))
    return out


@dataclass
class Verdict:
    accepted: list[Finding]
    new: list[Finding]
    stale: list[str]  # "CHECK Kind/name" of exceptions that match nothing any more

    @property
    def clean(self) -> bool:
        return not self.new and not self.stale


def judge(found: set[Finding], exceptions: list[Accepted]) -> Verdict:
    accepted = sorted(f for f in found if any(e.covers(f) for e in exceptions))
    new = sorted(f for f in found if f not in accepted)
    stale = []
    for e in exceptions:
        for obj in e.objects:
            if not any(f.check == e.check and (obj == EVERY or f.object == obj) for f in found):
                stale.append(f"{e.check} {obj}")
    return Verdict(accepted, new, stale)


def docs_table(exceptions: list[Accepted]) -> str:
    rows = ["| check | what it asks | where | why it stays |", "|---|---|---|---|"]
    for e in exceptions:
        rows.append(f"| `{e.check}` | {e.title} | {e.applies} | {e.reason} |")
    return "\n".join(rows)


def docs_with_table(text: str, exceptions: list[Accepted]) -> str:
    start, end = text.find(DOCS_START), text.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f"{DOCS_FILE.name} lacks the markers {DOCS_START} ... {DOCS_END}")
    return text[: start + len(DOCS_START)] + "\n" + docs_table(exceptions) + "\n" + text[end:]


def scanned_objects(workdir: Path, helm: Path) -> dict[str, list[dict[str, Any]]]:
    """File name -> objects: the chart's defaults and the examples bound to each example pool."""
    files = {"chart-defaults.yaml": chart_render(helm)}
    for pool, objects in examples_bound_to_each_pool(workdir / "inputs").items():
        files[f"examples-bound-to-{pool.replace('/', '-')}.yaml"] = objects
    return files


def run_checkov(checkov: Path, directory: Path) -> dict[str, Any] | list[dict[str, Any]]:
    result = subprocess.run(
        [
            str(checkov),
            "--directory",
            str(directory),
            "--framework",
            "kubernetes",
            "--skip-download",
            "--output",
            "json",
            "--compact",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    # Exit 1 means "findings"; anything else, or no JSON, means checkov itself failed.
    if result.returncode not in (0, 1) or not result.stdout.strip().startswith(("{", "[")):
        raise RuntimeError(f"checkov failed (exit {result.returncode}): {result.stderr[-2000:]}")
    return json.loads(result.stdout)


def _summary(report: dict[str, Any] | list[dict[str, Any]]) -> tuple[int, int, str]:
    parts = report if isinstance(report, list) else [report]
    passed = sum(p.get("summary", {}).get("passed", 0) for p in parts)
    failed = sum(p.get("summary", {}).get("failed", 0) for p in parts)
    version = parts[0].get("summary", {}).get("checkov_version", "?") if parts else "?"
    return passed, failed, version


def scan(checkov: Path, helm: Path) -> Verdict:
    with tempfile.TemporaryDirectory(prefix="maru-scan-") as tmp:
        workdir = Path(tmp)
        manifests = workdir / "manifests"
        manifests.mkdir()
        everything = []
        for name, objects in scanned_objects(workdir, helm).items():
            (manifests / name).write_text(yaml.safe_dump_all(objects, sort_keys=False))
            everything += objects
        report = run_checkov(checkov, manifests)
    verdict = judge(findings(report, object_ids(everything)), load_exceptions())
    passed, failed, version = _summary(report)
    print(
        f"checkov {version}: {passed} checks passed and {failed} failed over {len(everything)} objects; "
        f"{len(verdict.accepted)} distinct findings are documented exceptions, {len(verdict.new)} are new"
    )
    for finding in verdict.new:
        print(f"  NEW  {finding}  (fix it, or add it with its reason to {EXCEPTIONS_FILE.relative_to(REPO)})")
    for entry in verdict.stale:
        print(f"  STALE  {entry}: matches no finding any more; remove it from {EXCEPTIONS_FILE.relative_to(REPO)}")
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.security.checkov_scan", description=__doc__.split("\n")[0])
    parser.add_argument("--checkov", type=Path, help="the checkov executable (make scan installs one in .tools)")
    parser.add_argument("--write-docs", action="store_true", help="regenerate the exceptions table of the docs")
    args = parser.parse_args(argv)
    if args.write_docs:
        DOCS_FILE.write_text(docs_with_table(DOCS_FILE.read_text(), load_exceptions()))
        print(f"wrote the exceptions table of {DOCS_FILE.relative_to(REPO)}")
        return 0
    if args.checkov is None:
        parser.error("--checkov is required to scan")
    from maru_localcluster.tools import helm_path

    return 0 if scan(args.checkov, helm_path()).clean else 1


if __name__ == "__main__":
    sys.exit(main())
