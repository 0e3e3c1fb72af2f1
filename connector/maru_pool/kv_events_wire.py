"""vLLM's KV event wire format (``vllm.distributed.kv_events`` in vLLM 0.32), without importing vLLM.

The pool image carries neither vLLM nor torch, so the structs are declared here with the names, tags,
fields and options of vLLM's own (``KVEventBatch``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``):
msgspec encodes them to the same bytes, which vLLM's decoder, llm-d's KV-cache indexer and Dynamo's router
read. A test encodes the same events with vLLM's classes and compares the bytes, so a change upstream fails
here rather than at a consumer. Fields vLLM gives defaults to and the pool has nothing to say about
(extra keys, KV cache groups, locality, session) are left out: vLLM omits them at their defaults too.

On the ZMQ socket every batch is one multipart message ``(topic, sequence, payload)``: the sequence an
8-byte big-endian counter from 0 per publisher, the payload the msgpack of a :class:`KVEventBatch`.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = bytes | int


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the events: tagged with the class name, encoded as a map."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def message(topic: str, seq: int, batch: KVEventBatch) -> tuple[bytes, bytes, bytes]:
    """The ZMQ multipart message of ``batch``, as vLLM's ``ZmqEventPublisher`` sends it."""
    return topic.encode("utf-8"), seq.to_bytes(8, "big"), encode(batch)


def block_hash(key: bytes, *, as_int: bool) -> BlockHash:
    """A chunk key as a block hash: the bytes, or (``as_int``) its last 8 bytes as an unsigned big-endian
    integer, which is what vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` and llm-d's indexer make of one."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1) if as_int else key


def decode(payload: bytes) -> Any:
    """The batch in ``payload`` (for tests and tools that read the stream back)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
