"""The one writer of ``bench/results.json``: each benchmark owns one key and replaces only that."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results.json"


def merge_results(key: str, figures: dict[str, Any], path: Path = RESULTS) -> Path:
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = figures
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)  # benchmarks run one after another, but a reader must never see half a file
    return path
