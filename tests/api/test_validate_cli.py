"""`maru-operator validate` refuses what the API server or the operator would refuse, naming the file, the
document, the field and the rule; it never exits 0 having checked nothing, and says what it skipped."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru_operator.cli import main

REPO = Path(__file__).resolve().parents[2]

POOL = """
apiVersion: maru.io/v1alpha1
kind: MaruPool
metadata: {name: local-shm}
spec: {backend: shm, size: 1Gi}
"""
GROUP = """
apiVersion: maru.io/v1alpha1
kind: InferenceGroup
metadata: {name: qwen, namespace: llm}
spec:
  model: {name: m}
  poolRef: {name: local-shm}
"""


def _validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    """The real command line, as a user runs it."""
    args = [sys.executable, "-m", "maru_operator", "validate"]
    for path in paths:
        args += ["-f", str(path)]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO)


def _run(capsys: pytest.CaptureFixture[str], *paths: Path | str) -> tuple[int, str]:
    """The same command in this process (faster): its exit status and everything it printed."""
    argv = ["validate"]
    for path in paths:
        argv += ["-f", str(path)]
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _file(tmp_path: Path, name: str, *documents: str) -> Path:
    path = tmp_path / name
    path.write_text("\n---\n".join(documents))
    return path


def test_examples_are_valid() -> None:
    result = _validate(REPO / "examples")
    assert result.returncode == 0, result.stdout + result.stderr
    ok = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(ok) == 4, result.stdout
    assert any(line.endswith("pool-shm.yaml, document 1: MaruPool local-shm") for line in ok), result.stdout
    assert any(line.endswith("inferencegroup.yaml, document 1: InferenceGroup llm/qwen-7b") for line in ok)
    assert any(line.endswith("inferencegroup-shm.yaml, document 1: InferenceGroup llm/qwen-small") for line in ok)
    assert "4 objects checked" in result.stdout.splitlines()[-1]


def test_demo_examples_are_valid_together(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, REPO / "examples" / "local")
    assert code == 0, out
    assert "0 notes" in out  # the group's pool is among the files: the reference was checked
    assert not re.search(r"^note ", out, re.M)


def test_schema_and_semantic_errors_are_all_reported(tmp_path: Path) -> None:
    bad = _file(
        tmp_path,
        "bad.yaml",
        """
apiVersion: maru.io/v1alpha1
kind: InferenceGroup
metadata: {name: chunky, namespace: llm}
spec:
  model: {name: m}
  poolRef: {name: p}
  connector: {chunkTokens: 100}
""",
        """
apiVersion: maru.io/v1alpha1
kind: InferenceGroup
metadata: {name: greedy, namespace: llm}
spec:
  model: {name: m}
  poolRef: {name: p}
  prefill: {tensorParallelSize: 4, resources: {limits: {nvidia.com/gpu: 2}}}
""",
        """
apiVersion: v1
kind: ConfigMap
metadata: {name: not-ours}
""",
    )
    result = _validate(bad)
    assert result.returncode == 1
    assert "bad.yaml, document 1: InferenceGroup llm/chunky: spec.connector.chunkTokens:" in result.stdout
    assert "bad.yaml, document 2: InferenceGroup llm/greedy: spec.prefill.tensorParallelSize:" in result.stdout
    # Another kind is not checked, and says so.
    assert re.search(r"^skip .*bad\.yaml, document 3: v1 ConfigMap not-ours: .*not checked", result.stdout, re.M)
    assert "Traceback" not in result.stderr


# --- Kinds and apiVersions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api_version", "kind", "message"),
    [
        (
            "maru.io/v1alpha1",
            "MaruPoll",
            'kind "MaruPoll" is not a kind this operator serves (MaruPool, InferenceGroup); did you mean MaruPool?',
        ),
        ("maru.io/v1alpha1", "marupool", "did you mean MaruPool? (kinds are case-sensitive)"),
        ("maru.io/v1alpha1", "Pool", 'kind "Pool" is not a kind this operator serves'),
        ("v1", "InferenceGroups", "did you mean InferenceGroup? (with apiVersion: maru.io/v1alpha1)"),
        (
            "maru.io/v1",
            "MaruPool",
            'apiVersion "maru.io/v1" is not served for MaruPool: this operator serves maru.io/v1alpha1',
        ),
        ("maru.io/v1beta9", "MaruPool", 'apiVersion "maru.io/v1beta9" is not served for MaruPool'),
        ("maru/v1alpha1", "InferenceGroup", 'apiVersion "maru/v1alpha1" is not served for InferenceGroup'),
        (None, "MaruPool", "MaruPool without apiVersion: write apiVersion: maru.io/v1alpha1"),
    ],
)
def test_a_kind_or_apiversion_not_quite_ours_is_an_error(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    api_version: str | None,
    kind: str,
    message: str,
) -> None:
    head = f"apiVersion: {api_version}\n" if api_version else ""
    typo = f"{head}kind: {kind}\nmetadata: {{name: x}}\nspec: {{backend: shm, size: 1Gi}}\n"
    path = _file(tmp_path, "x.yaml", POOL, typo)
    code, out = _run(capsys, path)
    assert code == 1, out
    [line] = [line for line in out.splitlines() if "x.yaml, document 2: " in line]
    assert line.startswith("error ") and message in line, out
    assert re.search(r"^ok .*x\.yaml, document 1: MaruPool local-shm$", out, re.M)  # the rest is still checked


def test_a_kind_of_another_group_that_resembles_ours_is_skipped(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    # The Gateway API inference extension's InferencePool is a real kind next to InferenceGroups, not a typo.
    other = "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\nmetadata: {name: p}\n"
    code, out = _run(capsys, _file(tmp_path, "x.yaml", POOL, other))
    assert code == 0, out
    assert "x.yaml, document 2: inference.networking.x-k8s.io/v1alpha2 InferencePool p: not a kind" in out


def test_only_other_kinds_is_an_error_not_a_silent_pass(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    deployment = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\nspec: {}\n"
    code, out = _run(capsys, _file(tmp_path, "deploy.yaml", deployment))
    assert code == 1, out
    assert "deploy.yaml, document 1: apps/v1 Deployment web: not a kind this operator serves, not checked" in out
    assert "nothing checked: no MaruPool or InferenceGroup in the input (1 object of other kinds skipped)" in out


def test_other_kinds_next_to_ours_are_skipped_and_said_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    namespace = "apiVersion: v1\nkind: Namespace\nmetadata: {name: llm}\n"
    code, out = _run(capsys, _file(tmp_path, "gitops.yaml", namespace, POOL, GROUP))
    assert code == 0, out
    assert re.search(
        r"^skip .*gitops\.yaml, document 1: v1 Namespace llm: not a kind this operator serves", out, re.M
    ), out
    assert "1 skipped" in out.splitlines()[-1]


def test_a_list_is_checked_item_by_item(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    listed = (
        "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: maru.io/v1alpha1, kind: MaruPool, "
        "metadata: {name: p}, spec: {backend: shm, size: 1.5Gi}}\n"
    )
    code, out = _run(capsys, _file(tmp_path, "got.yaml", listed))
    assert code == 1, out
    assert 'got.yaml, document 1, item 1: MaruPool p: spec.size: Invalid value: "1.5Gi"' in out


# --- Empty input, YAML errors, usage ------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "---\n", "# just a comment\n---\n# and another\n", "---\n---\n"])
def test_a_file_with_no_objects_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(content)
    code, out = _run(capsys, path)
    assert code == 1, out
    assert "empty.yaml: no objects: the file is empty or holds only comments and ---" in out


def test_a_directory_with_no_yaml_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("not yaml")
    (tmp_path / "pools").mkdir()
    (tmp_path / "pools" / "pool.yaml").write_text(POOL)
    code, out = _run(capsys, tmp_path)
    assert code == 1, out
    assert (
        f"{tmp_path}: no *.yaml or *.yml file in this directory, nothing to check (subdirectories are not read" in out
    )


def test_an_empty_file_among_good_ones_is_still_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "a-pool.yaml").write_text(POOL)
    (tmp_path / "b-empty.yaml").write_text("# TODO\n")
    code, out = _run(capsys, tmp_path)
    assert code == 1, out
    assert "b-empty.yaml: no objects" in out
    assert "a-pool.yaml, document 1: MaruPool local-shm" in out


@pytest.mark.parametrize(
    ("content", "where", "problem"),
    [
        (
            "apiVersion: maru.io/v1alpha1\nkind: MaruPool\nmetadata: {name: p\nspec: {}\n",
            "bad.yaml:4:5",
            "YAML syntax error",
        ),
        (
            "apiVersion: maru.io/v1alpha1\nkind: MaruPool\nspec:\n  backend: shm\n size: 1Gi\n",
            "bad.yaml:5:2",
            "YAML syntax error",
        ),
        (
            "apiVersion: maru.io/v1alpha1\nkind: MaruPool\nmetadata: {name: p}\nspec:\n  backend: shm\n  size: 1Gi\n"
            "  size: 2Gi\n",
            "bad.yaml:7:3",
            'YAML error: key "size" appears twice in one mapping (first on line 6)',
        ),
    ],
)
def test_a_yaml_error_names_the_file_line_and_column(tmp_path: Path, content: str, where: str, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = _validate(path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{where}: {problem}" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(POOL)
    result = _validate(tmp_path / "pool.yaml", tmp_path / "nope.yaml")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{tmp_path / 'nope.yaml'}: no such file or directory" in result.stderr
    assert result.stdout == ""  # nothing is checked when the command line is wrong


def test_without_cel_python_it_refuses_to_pass_anything(tmp_path: Path) -> None:
    """The operator image has no cel-python: a run there must not report files valid with the CEL rules unread."""
    pool = tmp_path / "pool.yaml"
    pool.write_text(POOL)
    hidden = (
        "import sys, runpy; sys.modules['celpy'] = None; "
        "sys.argv = ['maru-operator', 'validate', '-f', sys.argv[1]]; "
        "runpy.run_module('maru_operator', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", hidden, str(pool)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 2, result
    assert "cel-python" in result.stderr and "maru-pd[validate]" in result.stderr, result.stderr


def test_standard_input(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "maru_operator", "validate", "-f", "-"],
        input=POOL + "---" + GROUP,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok     <stdin>, document 2: InferenceGroup llm/qwen" in result.stdout


# --- Patterns in words --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "words"),
    [
        ("1.5Gi", "fractions are not accepted"),
        ("2.5Gi", "2.5Gi is exactly 2560Mi"),
        ("3e9", "3e9 is exactly 3G"),
        ("512m", "512m is 0.512 bytes"),
        ("64GB", "write the unit without B"),
        ("lots", "a pool size is a positive whole number of bytes"),
    ],
)
def test_a_bad_pool_size_is_explained_in_words(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    size: str,
    words: str,
) -> None:
    pool = POOL.replace("size: 1Gi", f"size: {size}")
    code, out = _run(capsys, _file(tmp_path, "pool.yaml", pool))
    assert code == 1, out
    assert f'pool.yaml, document 1: MaruPool local-shm: spec.size: Invalid value: "{size}" is not a pool size: ' in out
    assert words in out
    assert "Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or k, M, G, T, P, E (powers of 1000)" in out
    assert "must match" not in out and "[1-9]" not in out


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("spec.daemon.resources.limits.memory", "16 GB", "remove the spaces"),
        ("spec.daemon.resources.requests.cpu", "1gi", "suffixes are case-sensitive: Ki, Mi, Gi, Ti, Pi, Ei"),
    ],
)
def test_a_bad_quantity_is_explained_in_words(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    field: str,
    value: str,
    words: str,
) -> None:
    kind = field.split(".")[-2]
    pool = POOL.replace(
        "size: 1Gi}", f"size: 1Gi, daemon: {{resources: {{{kind}: {{{field.split('.')[-1]}: '{value}'}}}}}}}}"
    )
    code, out = _run(capsys, _file(tmp_path, "pool.yaml", pool))
    assert code == 1, out
    assert f'{field}: Invalid value: "{value}" is not a Kubernetes quantity: {words}; a quantity is a number' in out
    assert "must match" not in out


def test_a_bad_name_is_explained_in_words(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    group = GROUP.replace("name: local-shm", "name: Local_SHM").replace("namespace: llm", "namespace: LLM")
    code, out = _run(capsys, _file(tmp_path, "g.yaml", group))
    assert code == 1, out
    assert 'metadata.namespace: Invalid value: "LLM" is not a DNS label: upper-case letters are not allowed' in out
    assert 'spec.poolRef.name: Invalid value: "Local_SHM" is not a DNS subdomain name' in out


def _patterns(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        if isinstance(schema.get("pattern"), str):
            yield schema["pattern"]
        for value in schema.values():
            yield from _patterns(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _patterns(value)


def test_every_pattern_in_the_crds_has_words() -> None:
    from maru_operator.crdgen import KINDS, build_crd
    from maru_operator.crdvalidate import PATTERNS

    found = {p for kind in KINDS for p in _patterns(build_crd(kind))}
    assert found, "no pattern found: the walk is broken"
    assert found - set(PATTERNS) == set(), "add these patterns to crdvalidate.PATTERNS"


def test_a_mistyped_field_gets_a_suggestion(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out = _run(capsys, _file(tmp_path, "g.yaml", GROUP + "  prefil: {replicas: 2}\n"))
    assert code == 1, out
    assert "spec.prefil: field not declared in schema; did you mean prefill?" in out


# --- Objects checked together -------------------------------------------------------------------------


def test_a_pool_ref_to_a_pool_not_given_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    group = GROUP.replace("poolRef: {name: local-shm}", "poolRef: {name: local-shn}")
    code, out = _run(capsys, _file(tmp_path, "pool.yaml", POOL), _file(tmp_path, "group.yaml", group))
    assert code == 1, out
    assert (
        "group.yaml, document 1: InferenceGroup llm/qwen: spec.poolRef.name: MaruPool local-shn does not exist" in out
    )
    assert "did you mean local-shm?" in out


def test_a_pool_ref_without_any_pool_is_a_note(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out = _run(capsys, _file(tmp_path, "group.yaml", GROUP))
    assert code == 0, out
    assert re.search(r"^ok .*group\.yaml, document 1: InferenceGroup llm/qwen$", out, re.M), out
    assert re.search(
        r"^note .*group\.yaml, document 1: InferenceGroup llm/qwen: spec\.poolRef\.name: no MaruPool "
        r"among the files given, so MaruPool local-shm was not checked",
        out,
        re.M,
    ), out
    assert "1 note" in out.splitlines()[-1]


def test_a_pool_that_does_not_admit_the_namespace_is_an_error(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    pool = POOL.replace("size: 1Gi}", "size: 1Gi, allowedNamespaces: [serving]}")
    code, out = _run(capsys, _file(tmp_path, "all.yaml", pool, GROUP))
    assert code == 1, out
    assert (
        "all.yaml, document 2: InferenceGroup llm/qwen: spec.poolRef.name: MaruPool local-shm does not list "
        "namespace llm in spec.allowedNamespaces" in out
    )
    assert "all.yaml, document 1)" in out  # where the pool is


def test_a_group_without_a_namespace_and_a_restricted_pool_is_a_note(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    pool = POOL.replace("size: 1Gi}", "size: 1Gi, allowedNamespaces: [serving]}")
    code, out = _run(capsys, _file(tmp_path, "all.yaml", pool, GROUP.replace(", namespace: llm", "")))
    assert code == 0, out
    assert "InferenceGroup qwen: metadata.namespace: not set" in out
    assert "MaruPool local-shm admits only serving" in out


def test_settings_that_must_agree_with_the_pool(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pool = POOL.replace("size: 1Gi}", "size: 1Gi, nodeSelector: {maru.io/pool: 'yes'}}")
    group = (
        GROUP
        + """  prefill:
    nodeSelector: {maru.io/pool: 'no'}
    volumes: [{name: run, emptyDir: {}}]
    volumeMounts: [{name: run, mountPath: /run}]
"""
    )
    code, out = _run(capsys, _file(tmp_path, "all.yaml", pool, group))
    assert code == 1, out
    assert (
        "InferenceGroup llm/qwen: spec.prefill.nodeSelector: maru.io/pool=no contradicts the pool local-shm's "
        "nodeSelector maru.io/pool=yes" in out
    )
    assert "InferenceGroup llm/qwen: spec.prefill.volumeMounts: /run overlaps /run/maru" in out


def test_the_same_object_twice_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out = _run(capsys, _file(tmp_path, "a.yaml", POOL), _file(tmp_path, "b.yaml", POOL.replace("1Gi", "2Gi")))
    assert code == 1, out
    assert "b.yaml, document 1: MaruPool local-shm: the same MaruPool as " in out
    assert "a.yaml, document 1" in out
