"""The capped hit: how many prompt tokens the connector may report as loadable.

vLLM's scheduler needs at least one token of engine work for every scheduled request
(``assert num_new_tokens > 0``). A connector that reports a fully cached prompt as fully loadable
leaves it none, and the engine dies on prompts whose length is an exact multiple of the chunk
size. So the hit is capped at ``prompt_len - 1`` *before* it is aligned down to the block size:
capping after alignment could produce an unaligned count, which the block table cannot express.
The engine then recomputes the last block over KV it could have loaded, with the same values.

Pure arithmetic, no vLLM import: the scheduler half calls it, tests enumerate shapes against it.
"""

from __future__ import annotations


def capped_hit_tokens(
    *,
    chunks_hit: int,
    chunk_tokens: int,
    prompt_len: int,
    block_size: int,
    num_computed_tokens: int,
) -> int:
    """Tokens beyond ``num_computed_tokens`` that the engine may take from the pool.

    ``chunks_hit`` is the count of leading prompt chunks committed in the pool,
    ``num_computed_tokens`` what the engine already holds (local prefix cache, block-aligned).
    The result is never negative, never reaches ``prompt_len`` and, added to a block-aligned
    ``num_computed_tokens``, stays block-aligned.
    """
    if chunk_tokens <= 0 or block_size <= 0:
        raise ValueError("chunk_tokens and block_size must be positive")
    if chunks_hit <= 0 or prompt_len <= 1:
        return 0
    matched = min(chunks_hit * chunk_tokens, prompt_len - 1)
    matched -= matched % block_size
    return max(0, matched - num_computed_tokens)


def uncapped_hit_tokens(
    *,
    chunks_hit: int,
    chunk_tokens: int,
    prompt_len: int,
    block_size: int,
    num_computed_tokens: int,
) -> int:
    """The upstream rule without the cap. Kept only so a test can show the engine dies with it."""
    if chunks_hit <= 0:
        return 0
    matched = min(chunks_hit * chunk_tokens, prompt_len)
    matched -= matched % block_size
    return max(0, matched - num_computed_tokens)


def full_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """Chunks whose every token lies within the first ``num_tokens`` tokens."""
    return max(0, num_tokens) // chunk_tokens
