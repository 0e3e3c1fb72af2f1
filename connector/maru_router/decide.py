"""When a prompt may skip prefill: the coverage threshold (pure arithmetic)."""

from __future__ import annotations

import math

from maru_contracts import hits


def chunks_needed(prompt_len: int, chunk_tokens: int, min_coverage: float) -> int | None:
    """Leading chunks the pool must hold for decode alone to serve the prompt; None: always prefill.

    ``min_coverage`` is the share of the prompt's full chunks (1.0, the default, means all of them:
    only the last partial chunk, and the token the capped hit keeps back, are left to decode). A
    prompt without a full chunk has nothing the pool could give, so it always goes through prefill.
    """
    if not 0.0 < min_coverage <= 1.0:
        raise ValueError(f"min_coverage must be in (0, 1], got {min_coverage}")
    full = hits.full_chunks(prompt_len, chunk_tokens)
    if full <= 0:
        return None
    return max(1, math.ceil(min_coverage * full - 1e-9))


def decode_direct(chunks_hit: int, prompt_len: int, chunk_tokens: int, min_coverage: float) -> bool:
    need = chunks_needed(prompt_len, chunk_tokens, min_coverage)
    return need is not None and chunks_hit >= need
