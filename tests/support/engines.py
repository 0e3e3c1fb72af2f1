"""What the real-engine tests share: block and chunk sizes and the counter deltas they read from an engine."""

from __future__ import annotations

CHUNK = 256

BLOCK = 128  # the CPU attention backend's block size


def delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)
