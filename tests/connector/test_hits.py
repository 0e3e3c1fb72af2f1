"""The capped hit over many prompt shapes, and the rows of the bug report it prevents."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from maru_contracts.hits import capped_hit_tokens, full_chunks, uncapped_hit_tokens


def hit(chunks_hit: int, prompt_len: int, *, chunk: int = 256, block: int = 16, computed: int = 0) -> int:
    return capped_hit_tokens(
        chunks_hit=chunks_hit, chunk_tokens=chunk, prompt_len=prompt_len, block_size=block, num_computed_tokens=computed
    )


@pytest.mark.parametrize(
    ("prompt_len", "chunks", "reported"),
    [
        (8192, 32, 8176),  # exact multiple: capped at 8191, aligned down to 8176
        (32768, 128, 32752),
        (8210, 32, 8192),  # a remainder: reported as before
        (3858, 15, 3840),
    ],
)
def test_reference_table(prompt_len: int, chunks: int, reported: int) -> None:
    assert hit(chunks, prompt_len) == reported
    assert prompt_len - reported > 0


@pytest.mark.parametrize("prompt_len", [64, 128, 256])
def test_exact_multiples_leave_work_and_stay_aligned(prompt_len: int) -> None:
    got = capped_hit_tokens(
        chunks_hit=prompt_len // 64, chunk_tokens=64, prompt_len=prompt_len, block_size=16, num_computed_tokens=0
    )
    assert got < prompt_len
    assert got % 16 == 0
    assert got == prompt_len - 16


def test_uncapped_rule_reports_the_whole_prompt() -> None:
    # The rule the cap replaces: the engine would be left with nothing to compute.
    got = uncapped_hit_tokens(chunks_hit=32, chunk_tokens=256, prompt_len=8192, block_size=16, num_computed_tokens=0)
    assert got == 8192


def test_cpu_block_size() -> None:
    # CPU attention uses 128-token blocks: a 2048-token prompt loads 1920 and computes the last block.
    assert hit(8, 2048, block=128) == 1920
    assert hit(1, 200, block=128) == 128
    assert hit(0, 200, block=128) == 0
    assert hit(1, 256, block=128) == 128


def test_nothing_to_load_for_tiny_prompts() -> None:
    assert hit(5, 1) == 0
    assert hit(5, 0) == 0


shapes = st.tuples(
    st.sampled_from([16, 32, 64, 128]),  # block size
    st.integers(1, 8),  # blocks per chunk
    st.integers(0, 40_000),  # prompt length
    st.integers(0, 200),  # chunks hit (may exceed what the prompt holds)
    st.integers(0, 3000),  # local blocks
)


@given(shapes)
def test_invariants(shape: tuple[int, int, int, int, int]) -> None:
    block, per_chunk, prompt_len, chunks_hit, local_blocks = shape
    chunk = block * per_chunk
    chunks_hit = min(chunks_hit, full_chunks(prompt_len, chunk))
    computed = min(local_blocks * block, max(0, (prompt_len - 1) // block * block))
    got = hit(chunks_hit, prompt_len, chunk=chunk, block=block, computed=computed)
    assert got >= 0
    # The engine always keeps at least one token to compute.
    assert computed + got <= max(0, prompt_len - 1) or got == 0
    # Loaded tokens end on a block boundary, so the block table can express them.
    assert (computed + got) % block == 0 or got == 0
    # Never more than the pool holds.
    assert computed + got <= max(computed, chunks_hit * chunk)
    # Nothing is lost beyond the one block the cap must give back.
    if got:
        assert computed + got >= min(chunks_hit * chunk, prompt_len - 1) - block + 1


@given(st.integers(1, 300), st.sampled_from([16, 128]), st.integers(1, 4))
def test_exact_multiple_fully_hit_never_reports_the_whole_prompt(n_chunks: int, block: int, per_chunk: int) -> None:
    chunk = block * per_chunk
    prompt_len = n_chunks * chunk
    got = hit(n_chunks, prompt_len, chunk=chunk, block=block)
    assert got == prompt_len - block
    assert (
        uncapped_hit_tokens(
            chunks_hit=n_chunks, chunk_tokens=chunk, prompt_len=prompt_len, block_size=block, num_computed_tokens=0
        )
        == prompt_len
    )


def test_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError):
        hit(1, 100, chunk=0)
