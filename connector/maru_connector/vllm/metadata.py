"""What the scheduler half tells the worker half each step, and what workers tell the scheduler once.

Plain dataclasses: vLLM pickles the step metadata to every worker process. Built once per step in
``MaruConnector.build_connector_meta``; the worker never mutates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


@dataclass(frozen=True)
class ChunkLoad:
    """Copy one pool chunk into the engine's blocks."""

    # One key per TP rank; a worker reads keys[tp_rank].
    keys: tuple[bytes, ...]
    # (block index within the chunk, destination block id): only the blocks the engine will not
    # compute itself or hold already (local prefix-cache hits stay untouched).
    slots: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ChunkSave:
    """Copy the engine's blocks of one fully computed prompt chunk into the pool."""

    keys: tuple[bytes, ...]
    # Source block ids, in chunk order; exactly blocks_per_chunk of them.
    block_ids: tuple[int, ...]


@dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    """The step's work for the worker half: loads run before the forward, saves after it."""

    # req_id -> chunks to load, in prompt order; a failed chunk invalidates the ones after it.
    loads: dict[str, list[ChunkLoad]] = field(default_factory=dict)
    # req_id -> chunks to save, in prompt order.
    saves: dict[str, list[ChunkSave]] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class MaruWorkerInfo(KVConnectorHandshakeMetadata):
    """Sent once by each worker after it registered its KV caches (vLLM's handshake path).

    The scheduler half cannot see the attention backend, yet the KV layout is part of every key:
    it waits for this before it looks anything up.
    """

    kv_layout: str
    tp_rank: int
    block_bytes: int
    num_layers: int
