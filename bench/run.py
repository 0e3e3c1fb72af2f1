"""Run every benchmark in this folder, one process each, and print where the results went.

Each ``bench_*.py`` measures its subject against a baseline in the same process, prints its own
table and merges its figures into ``bench/results.json`` under its own key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    failed = []
    for script in scripts:
        print(f"== {script.name}", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        print(f"== {script.name}: exit {code} after {time.monotonic() - started:.0f} s\n", flush=True)
        if code:
            failed.append(script.name)
    results = HERE / "results.json"
    if results.exists():
        print(f"results: {results.relative_to(HERE.parent)} ({', '.join(json.loads(results.read_text()))})")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
