"""The benchmarks still load against the code they measure (``make bench`` is not part of ``make test``).

Importing a benchmark builds its module-level fixtures (key namespaces, prompts, configs) from the
product's own types, so a changed constructor or a renamed helper fails here, not at the next ``make bench``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.name for p in (REPO / "bench").glob("bench_*.py"))


@pytest.mark.parametrize("script", BENCHES)
def test_a_benchmark_loads(script: str) -> None:
    # Its own process, as bench/run.py runs it: each benchmark puts its own folders on sys.path.
    bench = str(REPO / "bench")
    code = (
        f"import runpy, sys; sys.path.insert(0, {bench!r}); "
        f"runpy.run_path({bench + '/' + script!r}, run_name='bench_import_check')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
