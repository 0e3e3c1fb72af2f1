"""``maru-operator validate``: the checks the API server and the operator would make, offline, for files.

Every document of every file given gets one verdict, named by file and document index: checked (``ok``
or its errors), or skipped (an object of another kind, said so). What looks meant for this operator but is
not quite (a kind that is a typo of ours, an apiVersion this operator does not serve) is an error, never a
skip; and input that holds nothing to check (an empty file, a directory without YAML, only objects of other
kinds) is an error too, so the command never succeeds having checked nothing.

The objects given together are also checked against each other, with the operator's own functions: a
group's poolRef against the pools given (:func:`maru_operator.status.bind`, which also applies the pool's
allowedNamespaces), and what must agree between a group and its pool
(:func:`maru_operator.validation.check_group_on_pool`).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from maru_operator import conditions as cond
from maru_operator.api.common import API_VERSION, GROUP
from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.group import PoolView
from maru_operator.crdgen import KINDS
from maru_operator.crdvalidate import Validator
from maru_operator.objects import Object
from maru_operator.status import bind
from maru_operator.validation import check_group, check_group_on_pool, check_pool

SERVED: tuple[str, ...] = tuple(kind.kind for kind in KINDS)
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
STDIN = "-"
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Where:
    """A place in the input: a file, or one of its documents (1-based, empty ones counted), or a List item."""

    file: str
    document: int | None = None
    item: int | None = None

    def __str__(self) -> str:
        text = self.file if self.document is None else f"{self.file}, document {self.document}"
        return text if self.item is None else f"{text}, item {self.item}"


@dataclass
class Checked:
    """One MaruPool or InferenceGroup and what was found about it."""

    where: Where
    body: Object
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pool: MaruPoolSpec | None = None
    group: InferenceGroupSpec | None = None

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name") or "(no name)")

    @property
    def namespace(self) -> str | None:
        namespace = (self.body.get("metadata") or {}).get("namespace")
        return str(namespace) if namespace else None

    def __str__(self) -> str:
        if self.kind == "InferenceGroup" and self.namespace:
            return f"{self.kind} {self.namespace}/{self.name}"
        return f"{self.kind} {self.name}"


Line = tuple[str, Where, str]


@dataclass
class Report:
    """What was found, in input order: objects checked, and lines about the rest (errors, skips)."""

    entries: list[Checked | Line] = field(default_factory=list)

    def add(self, tag: str, where: Where, text: str) -> None:
        self.entries.append((tag, where, text))

    @property
    def checked(self) -> list[Checked]:
        return [e for e in self.entries if isinstance(e, Checked)]

    def lines(self) -> list[Line]:
        """``(tag, where, text)``; tag is ok, error, note or skip."""
        lines: list[Line] = []
        for entry in self.entries:
            if not isinstance(entry, Checked):
                lines.append(entry)
                continue
            if entry.errors:
                lines += [("error", entry.where, f"{entry}: {e}") for e in entry.errors]
            else:
                lines.append(("ok", entry.where, str(entry)))
            lines += [("note", entry.where, f"{entry}: {n}") for n in entry.notes]
        return lines


# --- Reading ------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; a GitOps diff would then not show what counts."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                first = seen[key].start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f'key "{key}" appears twice in one mapping (first on line {first}); only one can count',
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _label(file: str) -> str:
    return "<stdin>" if file == STDIN else file


def missing_paths(paths: Sequence[str]) -> list[str]:
    return [p for p in paths if p != STDIN and not Path(p).exists()]


def _files(paths: Sequence[str], report: Report) -> list[str]:
    """The files to read, in order, each once; a directory without YAML is reported here."""
    files: list[str] = []
    for raw in paths:
        path = Path(raw)
        if raw == STDIN or not path.is_dir():
            found = [raw]
        else:
            found = sorted(str(p) for p in path.iterdir() if p.suffix in YAML_SUFFIXES and p.is_file())
            if not found:
                below = (
                    " (subdirectories are not read: give them with -f)"
                    if any(p.is_dir() for p in path.iterdir())
                    else ""
                )
                report.add("error", Where(raw), f"no *.yaml or *.yml file in this directory, nothing to check{below}")
        for file in found:
            same = [f for f in files if f != STDIN and file != STDIN and Path(f).resolve() == Path(file).resolve()]
            if not same:
                files.append(file)
    return files


def _read(file: str, report: Report) -> str | None:
    try:
        if file == STDIN:
            return sys.stdin.read()
        return Path(file).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        report.add("error", Where(_label(file)), "not UTF-8 text: a YAML file was expected")
    except OSError as err:
        report.add("error", Where(_label(file)), f"cannot be read: {err.strerror or err}")
    return None


def _documents(file: str, text: str, report: Report) -> Iterator[tuple[int, Any]]:
    """``(index, document)`` for every document, empty ones included so the index matches the ``---``."""
    loader = _Loader(text)
    index = 0
    try:
        while loader.check_node():
            node = loader.get_node()
            index += 1
            yield index, loader.construct_document(node)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        place = f"{_label(file)}:{mark.line + 1}:{mark.column + 1}" if mark else _label(file)
        context = f" ({err.context})" if err.context and err.problem else ""
        what = "YAML error" if isinstance(err, yaml.constructor.ConstructorError) else "YAML syntax error"
        report.add("error", Where(place), f"{what}: {err.problem or err.context}{context}")
    except yaml.YAMLError as err:
        report.add("error", Where(_label(file)), f"YAML error: {err}")
    finally:
        loader.dispose()


def _objects(file: str, report: Report) -> Iterator[tuple[Where, Any]]:
    """Every object of a file; a file that holds none is an error, as kubectl would apply nothing from it."""
    text = _read(file, report)
    if text is None:
        return
    found = False
    entries_before = len(report.entries)
    for index, doc in _documents(file, text, report):
        if doc is None:
            continue  # an empty document ("---" twice, a trailing "---"): kubectl skips it too
        found = True
        items = doc.get("items") if isinstance(doc, dict) else None
        if isinstance(doc, dict) and str(doc.get("kind", "")).endswith("List") and isinstance(items, list):
            # kubectl get -o yaml writes a List; kubectl apply takes its items one by one.
            for item_index, item in enumerate(items, 1):
                yield Where(_label(file), index, item_index), item
        else:
            yield Where(_label(file), index), doc
    if not found and len(report.entries) == entries_before:
        report.add("error", Where(_label(file)), "no objects: the file is empty or holds only comments and ---")


# --- One object ----------------------------------------------------------------------------------------


def _close(word: str, choices: Sequence[str], cutoff: float) -> str | None:
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[match[0]] if match else None


def classify(doc: Object) -> tuple[str, str]:
    """``("check", "")``, ``("skip", why)`` or ``("error", why)`` for one object."""
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    if not isinstance(kind, str) or not kind:
        return (
            "error",
            "no kind: every object needs apiVersion and kind (e.g. apiVersion: maru.io/v1alpha1, kind: MaruPool)",
        )
    if not isinstance(api_version, str) or not api_version:
        if kind in SERVED:
            return "error", f"{kind} without apiVersion: write apiVersion: {API_VERSION}"
        return "error", f'kind "{kind}" without apiVersion: every object needs one'
    # maru.io, maru, maru.com...: an object of such a group is meant for this operator, whatever its version.
    ours = api_version.split("/")[0].lower().split(".")[0] == GROUP.split(".")[0]
    if kind in SERVED:
        if api_version != API_VERSION:
            return (
                "error",
                f'apiVersion "{api_version}" is not served for {kind}: this operator serves '
                f"{API_VERSION} (write apiVersion: {API_VERSION})",
            )
        return "check", ""
    # Kinds of other groups may resemble ours by chance (the Gateway API's InferencePool is 0.74 like
    # InferenceGroup), so outside our group only a near-certain typo is an error.
    suggestion = _close(kind, SERVED, 0.6 if ours else 0.85)
    if ours or suggestion:
        hint = f"; did you mean {suggestion}?" if suggestion else ""
        if suggestion and suggestion.lower() == kind.lower():
            hint += " (kinds are case-sensitive)"
        if suggestion and api_version != API_VERSION:
            hint += f" (with apiVersion: {API_VERSION})"
        return "error", f'kind "{kind}" is not a kind this operator serves ({", ".join(SERVED)}){hint}'
    metadata = doc.get("metadata")
    name = f" {metadata['name']}" if isinstance(metadata, dict) and metadata.get("name") else ""
    return "skip", f"{api_version} {kind}{name}: not a kind this operator serves, not checked"


def _model_errors(err: ValidationError) -> list[str]:
    lines = []
    for error in err.errors():
        path = "spec"
        for part in error["loc"]:
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
        lines.append(f"{path}: {error['msg'].removeprefix('Value error, ')}")
    return lines


def check_object(obj: Checked, validator: Validator) -> None:
    """The CRD's schema and CEL rules, then the models and the operator's checks of the object alone."""
    obj.errors += [str(e) for e in validator.validate(obj.body)]
    if obj.errors:
        return  # the models would only restate what the schema refused, less precisely
    spec = obj.body.get("spec") or {}
    try:
        if obj.kind == "MaruPool":
            obj.pool = MaruPoolSpec.model_validate(spec)
            obj.errors += [str(e) for e in check_pool(obj.pool, obj.name)]
        else:
            obj.group = InferenceGroupSpec.model_validate(spec)
            obj.errors += [str(e) for e in check_group(obj.group)]
    except ValidationError as err:
        obj.errors += _model_errors(err)


# --- Objects together ---------------------------------------------------------------------------------


def _ready(body: Object) -> Object:
    # Offline the pool has no status; readiness is the cluster's business, so bind() is asked as if the pool
    # were Ready, which leaves it only the checks that the files decide (existence, allowedNamespaces).
    return {**body, "status": {"conditions": [{"type": cond.READY, "status": "True"}]}}


def check_together(objects: list[Checked]) -> None:
    """Duplicates, and every group against the pool it names, with the operator's own binding checks."""
    first: dict[tuple[str, str | None, str], Checked] = {}
    for obj in objects:
        key = (obj.kind, obj.namespace, obj.name)
        if key in first:
            obj.errors.append(f"the same {obj.kind} as {first[key].where}: applying both keeps only the last")
        else:
            first[key] = obj
    pools = {o.name: o for o in objects if o.kind == "MaruPool"}
    for obj in objects:
        if obj.group is None:
            continue
        ref = obj.group.pool_ref.name
        pool = pools.get(ref)
        if not pools:
            obj.notes.append(
                f"spec.poolRef.name: no MaruPool among the files given, so MaruPool {ref} was not checked (that it "
                "exists, that it admits this namespace, that it agrees with the group); give its file too (-f)"
            )
            continue
        if pool is None:
            guess = _close(ref, list(pools), 0.6)
            given = ", ".join(sorted(pools))
            obj.errors.append(
                f"spec.poolRef.name: {bind(obj.namespace or '', obj.group, None).message} (the "
                f"MaruPools given: {given}{f'; did you mean {guess}?' if guess else ''})"
            )
            continue
        if pool.pool is None:
            obj.notes.append(
                f"spec.poolRef.name: not checked against MaruPool {ref} ({pool.where}), which has errors of its own"
            )
            continue
        binding = bind(obj.namespace or "", obj.group, _ready(pool.body))
        if binding.reason == "NamespaceNotAllowed" and obj.namespace is None:
            obj.notes.append(
                f"metadata.namespace: not set, so kubectl puts the group in its context's namespace, which is not "
                f"known here; MaruPool {ref} admits only {', '.join(pool.pool.allowed_namespaces or [])}"
            )
        elif not binding.ok:
            obj.errors.append(f"spec.poolRef.name: {binding.message} ({pool.where})")
        view = binding.pool or PoolView(ref, pool.pool)
        obj.errors += [f"{e} ({pool.where})" for e in check_group_on_pool(obj.group, view)]


# --- The command --------------------------------------------------------------------------------------


def validate(paths: Sequence[str]) -> Report:
    report = Report()
    validator = Validator.from_models()
    for file in _files(paths, report):
        for where, doc in _objects(file, report):
            if not isinstance(doc, dict):
                report.add(
                    "error",
                    where,
                    "not a Kubernetes object: a mapping with apiVersion, kind, metadata and "
                    f"spec was expected, not a {type(doc).__name__}",
                )
                continue
            verdict, why = classify(doc)
            if verdict == "check":
                obj = Checked(where, doc)
                check_object(obj, validator)
                report.entries.append(obj)
            else:
                report.add(verdict, where, why)
    check_together(report.checked)
    lines = report.lines()
    if not report.checked and not any(tag == "error" for tag, _, _ in lines):
        skipped = sum(tag == "skip" for tag, _, _ in lines)
        report.add(
            "error",
            Where(", ".join(paths)),
            f"nothing checked: no {' or '.join(SERVED)} in the input ({_count(skipped, 'object')} of other "
            "kinds skipped)",
        )
    return report


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def summary(report: Report) -> str:
    lines = report.lines()
    count = {tag: sum(t == tag for t, _, _ in lines) for tag in ("error", "note", "skip")}
    failed = sum(bool(o.errors) for o in report.checked)
    verdict = "invalid" if count["error"] else "valid"
    return (
        f"{verdict}: {_count(len(report.checked), 'object')} checked ({len(report.checked) - failed} ok, "
        f"{failed} with errors), {count['skip']} skipped; {_count(count['error'], 'error')}, "
        f"{_count(count['note'], 'note')}"
    )


def _cel_available() -> bool:
    try:
        import celpy  # noqa: F401
    except ImportError:
        return False
    return True


def run(paths: Sequence[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the report; the exit status: 0 all valid, 1 an error or nothing checked, 2 a path that is not there."""
    # Looked up now, not at import: a caller (or a test) may have replaced them since.
    out, err = out or sys.stdout, err or sys.stderr
    missing = missing_paths(paths)
    if missing:
        for path in missing:
            print(f"maru-operator validate: error: {path}: no such file or directory", file=err)
        return EXIT_USAGE
    if not _cel_available():
        # Without it the CRDs' CEL rules could not be judged, and a file they refuse would pass.
        print(
            "maru-operator validate: error: the CRDs' CEL rules need cel-python: pip install 'maru-pd[validate]'",
            file=err,
        )
        return EXIT_USAGE
    report = validate(paths)
    lines = report.lines()
    for tag, where, text in lines:
        print(f"{tag:<6} {where}: {text}", file=out)
    print(summary(report), file=out)
    return EXIT_INVALID if any(tag == "error" for tag, _, _ in lines) else EXIT_OK
