"""What each KV cache group needs of a hit, held to what vLLM's own hybrid block manager allocates.

A two-group KVCacheConfig (full attention + a sliding window), vLLM's real Scheduler with its hybrid KV
cache manager on (no connector: these tests hold the arithmetic to vLLM's own allocator), and
``allocate_slots`` with external tokens as a connector hit makes it: the sliding-window group's blocks
before the window are vLLM's null block, and :func:`groups.load_slots` must name exactly the others.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from maru_connector.vllm.groups import KVGroup, held_blocks, hit_tokens, kv_groups, load_slots
from maru_contracts import hits
from maru_localcluster.tinymodel import make_tiny_llama

from .realsched import BS, HAS_REQ_ID_TO_INDEX, HD, HEADS, prompt

CHUNK = 2 * BS
WINDOW = 3 * BS  # spans parts of two chunks: a chunk the window starts inside is loaded from that block on


def two_groups(num_blocks: int) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32, sliding_window=WINDOW
    )
    groups = [KVCacheGroupSpec(["layer0"], full), KVCacheGroupSpec(["layer1"], window)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.fixture(scope="module")
def hybrid_scheduler(tmp_path_factory: pytest.TempPathFactory) -> Scheduler:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=4096, skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096, is_encoder_decoder=False
        ),
        device_config=DeviceConfig("cpu"),
    )
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager
    config.cache_config.num_gpu_blocks = 256
    return Scheduler(config, two_groups(256), StructuredOutputManager(config), block_size=BS)


def test_groups_are_read_from_the_kv_cache_config_with_labels_for_their_keys() -> None:
    full, window = kv_groups(two_groups(16))
    assert full == KVGroup(0, ("layer0",), None, "0/2:full")
    assert window == KVGroup(1, ("layer1",), WINDOW, f"1/2:sliding_window={WINDOW}")
    mamba = KVCacheGroupSpec(["m"], MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,)))
    attention = two_groups(16).kv_cache_groups[0]
    with pytest.raises(ValueError, match="KV cache group 1 holds MambaSpec"):
        kv_groups(KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[attention, mamba]))


@pytest.mark.parametrize("external", [3 * BS, 5 * BS, 7 * BS, 8 * BS])
def test_load_slots_are_exactly_the_blocks_vllm_allocates_for_a_hit(hybrid_scheduler: Scheduler, external: int) -> None:
    init_none_hash(get_hash_fn_by_name("sha256"))
    tokens = prompt(external + 9, seed=external)
    request = Request(
        f"r{external}",
        tokens,
        SamplingParams(max_tokens=2, ignore_eos=True),
        None,
        block_hasher=get_request_block_hasher(BS, get_hash_fn_by_name("sha256")),
    )
    manager = hybrid_scheduler.kv_cache_manager
    computed, local, *_ = manager.get_computed_blocks(request)
    assert local == 0
    blocks = manager.allocate_slots(
        request,
        len(tokens) - external,
        new_computed_blocks=computed,
        num_external_computed_tokens=external,
        delay_cache_blocks=True,
    )
    assert blocks is not None
    try:
        full_ids, window_ids = manager.get_block_ids(request.request_id)
        null = manager.block_pool.null_block.block_id
        full, window = kv_groups(two_groups(16))
        for group, ids in ((full, full_ids), (window, window_ids)):
            planned = load_slots(group, ids, 0, external, BS, CHUNK)
            written = {(chunk * (CHUNK // BS) + j, block) for chunk, slots in planned.items() for j, block in slots}
            # Every block of the hit that vLLM gave this request a block of its own, and nothing else.
            want = {(i, b) for i, b in enumerate(ids[: external // BS]) if b != null}
            assert written == want, (group.kind, ids)
        skipped = (external - WINDOW + 1) // BS
        assert window_ids[:skipped] == [null] * skipped and null not in window_ids[skipped:]
    finally:
        manager.free(request)


@pytest.mark.parametrize(
    ("present", "prompt_len", "want"),
    [
        # Everything stored: the capped hit (3 chunks, 6 blocks; the prompt's last block is recomputed).
        (({0, 1, 2}, {0, 1, 2}), 3 * CHUNK + 5, 3 * CHUNK),
        (({0, 1, 2}, {0, 1, 2}), 3 * CHUNK, 3 * CHUNK - BS),
        # The sliding group misses chunk 0: a hit ending at chunk 2 or 3 reads only chunks 1 and 2 there.
        (({0, 1, 2}, {1, 2}), 3 * CHUNK + 5, 3 * CHUNK),
        # A hit capped inside chunk 2 still reads only chunks 1 and 2 ...
        (({0, 1, 2}, {1, 2}), 2 * CHUNK + BS + 1, 2 * CHUNK + BS),
        # ... one ending at chunk 2 reads the last block of chunk 0 through its window, a shorter one all of it.
        (({0, 1, 2}, {1, 2}), 2 * CHUNK + 1, 0),
        # The full group misses chunk 1: only chunk 0 can be loaded, and the window then needs chunk 0.
        (({0, 2}, {0, 1, 2}), 3 * CHUNK + 5, CHUNK),
        (({0, 2}, {1, 2}), 3 * CHUNK + 5, 0),
    ],
)
def test_a_hit_counts_only_where_every_group_has_what_the_prefix_needs(
    present: tuple[set[int], set[int]], prompt_len: int, want: int
) -> None:
    groups = kv_groups(two_groups(16))

    def rule(chunks: int) -> int:
        return hits.capped_hit_tokens(
            chunks_hit=chunks, chunk_tokens=CHUNK, prompt_len=prompt_len, block_size=BS, num_computed_tokens=0
        )

    got = hit_tokens(groups, present, max_chunks=3, local_tokens=0, block_size=BS, chunk_tokens=CHUNK, rule=rule)
    assert got == want


def test_a_full_group_needs_every_chunk_and_a_window_only_its_own() -> None:
    full, window = kv_groups(two_groups(16))
    end = 4 * CHUNK  # computing token 4*CHUNK reads [end - WINDOW + 1, end): blocks 5..7, chunks 2 and 3
    assert list(full.needed_chunks(0, end, BS, CHUNK)) == [0, 1, 2, 3]
    assert list(window.needed_blocks(0, end, BS)) == [5, 6, 7]
    assert list(window.needed_chunks(0, end, BS, CHUNK)) == [2, 3]
    # Tokens the engine holds itself are never loaded, in either group.
    assert list(full.needed_chunks(3 * CHUNK, end, BS, CHUNK)) == [3]
    assert list(window.needed_blocks(3 * CHUNK, end, BS)) == [6, 7]


def test_a_sliding_window_group_lets_go_of_a_chunks_blocks_while_its_request_runs(
    hybrid_scheduler: Scheduler,
) -> None:
    """Why several groups stay refused: the save lane copies a chunk after the step that computed it,
    and by the next step vLLM has freed the sliding-window group's blocks of it (they may go to another
    request); a retry from the block table would read the null block."""
    init_none_hash(get_hash_fn_by_name("sha256"))
    request = Request(
        "runs-past-its-window",
        prompt(4 * CHUNK + 5, seed=9),
        SamplingParams(max_tokens=3, ignore_eos=True),
        None,
        block_hasher=get_request_block_hasher(BS, get_hash_fn_by_name("sha256")),
    )
    hybrid_scheduler.add_request(request)
    manager, null = hybrid_scheduler.kv_cache_manager, hybrid_scheduler.kv_cache_manager.block_pool.null_block.block_id
    per_chunk = CHUNK // BS
    tables = []
    for _ in range(2):
        out = hybrid_scheduler.schedule()
        tables.append(manager.get_block_ids(request.request_id))
        ids = list(out.num_scheduled_tokens)
        sampled = [
            [7] if hybrid_scheduler.requests[r].num_computed_tokens >= request.num_prompt_tokens else [] for r in ids
        ]
        by_index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if HAS_REQ_ID_TO_INDEX else {}
        hybrid_scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, **by_index, sampled_token_ids=sampled))
    (full_1, window_1), (full_2, window_2) = tables
    # The step that computes the prompt holds every chunk in both groups ...
    assert all(held_blocks(window_1, c, per_chunk, null) for c in range(4))
    # ... the next has freed the window group's blocks its window moved past (blocks 0-4 of 9: token 261
    # reads from token 166 on), in chunk 2 too, and none of the full group's.
    assert [held_blocks(window_2, c, per_chunk, null) is not None for c in range(4)] == [False, False, False, True]
    assert [held_blocks(full_2, c, per_chunk, null) for c in range(4)] == [
        held_blocks(full_1, c, per_chunk, null) for c in range(4)
    ]
    hybrid_scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)


def test_several_groups_the_connector_cannot_copy_are_refused_with_what_to_do() -> None:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from maru_connector.vllm.kvspec import kv_cache_problem

    assert kv_cache_problem(two_groups(16)) is None
    full = two_groups(16).kv_cache_groups[0]
    local = ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32, attention_chunk_size=4 * BS
    )
    wider = FullAttentionSpec(block_size=2 * BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32)
    for second, why in (
        (local, "its KV cache groups hold ChunkedLocalAttentionSpec, neither full nor sliding-window"),
        (wider, "its KV cache groups differ in block size or KV shape"),
    ):
        config = KVCacheConfig(
            num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[full, KVCacheGroupSpec(["x"], second)]
        )
        problem = kv_cache_problem(config)
        assert problem is not None and problem.startswith(why) and "--disable-hybrid-kv-cache-manager" in problem
