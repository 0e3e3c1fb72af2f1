"""`maru-operator validate` refuses what the API server or the operator would refuse, naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "maru_operator", "validate"]
    for path in paths:
        args += ["-f", str(path)]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_examples_are_valid() -> None:
    result = _validate(REPO / "examples")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": valid") == 3


def test_schema_and_semantic_errors_fail_and_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        """
apiVersion: maru.io/v1alpha1
kind: InferenceGroup
metadata: {name: chunky, namespace: llm}
spec:
  model: {name: m}
  poolRef: {name: p}
  connector: {chunkTokens: 100}
---
apiVersion: maru.io/v1alpha1
kind: InferenceGroup
metadata: {name: greedy, namespace: llm}
spec:
  model: {name: m}
  poolRef: {name: p}
  prefill: {tensorParallelSize: 4, resources: {limits: {nvidia.com/gpu: 2}}}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: not-ours}
"""
    )
    result = _validate(bad)
    assert result.returncode == 1
    assert "InferenceGroup chunky: spec.connector.chunkTokens:" in result.stdout
    assert "InferenceGroup greedy: spec.prefill.tensorParallelSize:" in result.stdout
    assert "not-ours" not in result.stdout
