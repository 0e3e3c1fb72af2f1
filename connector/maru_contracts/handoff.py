"""The handoff a producer hands its reader: the kv_transfer_params keys prefill returns, which decode's connector
and maru-router read."""

from __future__ import annotations

HANDOFF_CHUNKS = "maru_chunks"
HANDOFF_LAST_KEY = "maru_last_key"
# How the producing engine keys prompts (keys.KeyScheme): lets a router ask the pool what it holds of a prompt.
HANDOFF_KEY_SCHEME = "maru_key_scheme"
