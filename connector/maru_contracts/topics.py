"""The KV events topic an engine publishes under: the operator renders it, maru-router reads a key revision off it."""

from __future__ import annotations

TOPIC_PREFIX = "maru.io/kv-revision="


def events_topic(revision: str) -> str:
    """The KV events topic of an engine of key ``revision``."""
    return TOPIC_PREFIX + revision
