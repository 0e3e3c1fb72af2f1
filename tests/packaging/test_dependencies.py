"""What each distribution declares is what its code imports: no product module needs a package only the
tests install, no declared runtime dependency goes unused, and the test bed (maru_localcluster) is neither
in the product's wheel nor among its dependencies."""

from __future__ import annotations

import ast
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PRODUCT = REPO / "pyproject.toml"
TEST_BED = REPO / "localcluster" / "pyproject.toml"
PACKAGES = {
    PRODUCT: [REPO / "operator" / "maru_operator", *sorted((REPO / "connector").glob("maru_*/"))],
    TEST_BED: [REPO / "localcluster" / "maru_localcluster"],
}
FIRST_PARTY = {
    "maru_operator",
    "maru_contracts",
    "maru_common",
    "maru_connector",
    "maru_pool",
    "maru_csi",
    "maru_router",
    "maru_localcluster",
    "__future__",
}
# Product modules that import a development tool, each for a reason that keeps it out of every image.
DEV_ONLY_MODULES = {
    "connector/maru_csi/protogen.py": "runs protoc (grpcio-tools) for `make protos`, never at run time",
}


def _project(pyproject: Path) -> dict:
    return tomllib.loads(pyproject.read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def declared(pyproject: Path, *, extras: bool = True) -> set[str]:
    """The distributions ``pyproject`` declares for its code: runtime and every extra but ``dev``."""
    project = _project(pyproject)
    names = _names(project.get("dependencies", []))
    if extras:
        for extra, requirements in project.get("optional-dependencies", {}).items():
            if extra != "dev":
                names |= _names(requirements)
    return names


def imports_of(path: Path) -> set[str]:
    """Top-level modules ``path`` imports (at module level or inside functions), first party and stdlib left out."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in FIRST_PARTY}


@cache
def _distributions() -> dict[str, list[str]]:
    return packages_distributions()


def distributions_of(module: str) -> set[str]:
    return {canonicalize_name(d) for d in _distributions().get(module, [])}


def _modules(pyproject: Path) -> list[Path]:
    return sorted(f for package in PACKAGES[pyproject] for f in package.rglob("*.py"))


def test_every_import_of_a_distribution_is_declared_by_it() -> None:
    undeclared = []
    for pyproject in PACKAGES:
        allowed = declared(pyproject)
        for module in _modules(pyproject):
            if module.relative_to(REPO).as_posix() in DEV_ONLY_MODULES:
                continue
            for name in sorted(imports_of(module)):
                if not distributions_of(name) & allowed:
                    undeclared.append(
                        f"{module.relative_to(REPO)} imports {name} "
                        f"({', '.join(sorted(distributions_of(name))) or 'not installed'}), "
                        f"which {pyproject.relative_to(REPO)} does not declare"
                    )
    assert not undeclared, "\n".join(undeclared)


def test_every_runtime_dependency_is_imported() -> None:
    unused = []
    for pyproject in PACKAGES:
        imported = {d for module in _modules(pyproject) for name in imports_of(module) for d in distributions_of(name)}
        unused += [
            f"{pyproject.relative_to(REPO)} depends on {name}, which none of its modules imports"
            for name in sorted(declared(pyproject, extras=False) - imported)
        ]
    assert not unused, "\n".join(unused)


def test_the_test_bed_is_not_part_of_the_product() -> None:
    find = tomllib.loads(PRODUCT.read_text())["tool"]["setuptools"]["packages"]["find"]
    assert "localcluster" not in find["where"]
    assert "maru-localcluster" not in declared(PRODUCT)
    for module in _modules(PRODUCT):
        assert "maru_localcluster" not in {n.split(".")[0] for n in _all_imports(module)}, module


def test_the_dev_only_modules_are_named_for_what_they_import() -> None:
    for relative in DEV_ONLY_MODULES:
        assert (REPO / relative).is_file(), f"{relative} is gone: drop it from DEV_ONLY_MODULES"


def _all_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out
