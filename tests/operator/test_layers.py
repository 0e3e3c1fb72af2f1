"""Layers, enforced: pure modules stay pure, one module talks to the API, no engine in the operator."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    lint = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent)) or "lint-imports"
    result = subprocess.run(
        [lint, "--config", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "broken" in result.stdout and "0 broken" in result.stdout


def test_running_the_operator_loads_no_engine() -> None:
    code = (
        "import sys, maru_operator.cli, maru_operator.handlers, maru_operator.render\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'vllm_router', 'grpc'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
