"""Worker half of the Maru connector: copies KV blocks between the engine and the pool mapping.

Runs in each model worker (one per TP rank). Loads run in ``start_load_kv`` before the forward
that needs them; saves run in ``wait_for_save`` after the forward that computed them, and commit
before the step's output leaves the worker. All copying goes through ``layout.PagedKV``, the one
place that knows where KV bytes sit. Pool traffic per step: one batched call to pin or lease, one
to release or commit, whatever the number of layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maru_connector.config import MaruConnectorConfig
from maru_connector.layout import KVLayoutError, PagedKV, describe_kv_caches
from maru_connector.vllm import common
from maru_connector.vllm.metadata import ChunkLoad, MaruConnectorMetadata, MaruWorkerInfo

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class MaruWorker:
    """The worker-side state; the facade forwards vLLM's worker calls here."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        cfg: MaruConnectorConfig,
        *,
        loads: bool,
        saves: bool,
        tp_rank: int,
    ) -> None:
        self.cfg = cfg
        self.loads_enabled = loads
        self.saves_enabled = saves
        self.tp_rank = tp_rank
        self.block_size = vllm_config.cache_config.block_size
        cfg.check_block_size(self.block_size)
        self.blocks_per_chunk = cfg.chunk_tokens // self.block_size
        self._kv_cache_config = kv_cache_config
        self.paged: PagedKV | None = None
        self.stats = common.Counters()
        self.guard = common.PoolGuard(cfg, f"worker{tp_rank}", self.stats)
        # Destination block ids whose load failed since the last report to the scheduler.
        self._invalid_blocks: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Recognise the engine's KV layout once, at start; an unknown one raises ``KVLayoutError``."""
        groups = self._kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise KVLayoutError(f"one KV cache group is supported, the model has {len(groups)}")
        spec = groups[0].kv_cache_spec
        self.paged = describe_kv_caches(
            kv_caches, block_size=self.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size
        )
        common.log.info(
            "maru worker %d: KV layout %s, %d layers, %d bytes per block per layer, chunk %d bytes",
            self.tp_rank,
            self.paged.name,
            self.paged.num_layers,
            self.paged.block_bytes,
            self.paged.geometry(self.blocks_per_chunk).chunk_bytes,
        )

    def handshake(self) -> MaruWorkerInfo | None:
        if self.paged is None:
            return None
        return MaruWorkerInfo(
            kv_layout=self.paged.name,
            tp_rank=self.tp_rank,
            block_bytes=self.paged.block_bytes,
            num_layers=self.paged.num_layers,
        )

    # ------------------------------------------------------------------ loads

    def load(self, meta: MaruConnectorMetadata) -> set[str]:
        """Copy every planned chunk into its blocks; return the ids of requests whose load failed.

        All of the step's chunks are pinned in one round trip and released in one. A chunk that is
        missing (evicted since the lookup), unreadable or fails its checksum marks its destination
        blocks, and those of every later chunk of the request, as failed; vLLM then recomputes from
        the first failed block (kv_load_failure_policy=recompute).
        """
        failed: set[str] = set()
        if not meta.loads or self.paged is None:
            return failed
        keys = [chunk.keys[self.tp_rank] for chunks in meta.loads.values() for chunk in chunks]
        ok, pins = self.guard.call("load", lambda c, ks: c.open_read_many(ks), keys)
        pins = pins if ok and pins is not None else [None] * len(keys)
        try:
            at = 0
            for req_id, chunks in meta.loads.items():
                if not self._load_request(chunks, pins[at : at + len(chunks)], pool_ok=ok):
                    failed.add(req_id)
                at += len(chunks)
        finally:
            held = [p for p in pins if p is not None]
            if held:
                self.guard.call("release", lambda c, ps: c.release_many(ps), held)
        return failed

    def _load_request(self, chunks: list[ChunkLoad], pins: list, *, pool_ok: bool) -> bool:
        done = 0
        for chunk, pin in zip(chunks, pins, strict=True):
            if pin is None or not self._load_chunk(chunk, pin):
                break
            done += 1
        self.stats.count(common.LOADED_CHUNKS, done)
        if done == len(chunks):
            return True
        lost = [d for chunk in chunks[done:] for _, d in chunk.slots]
        self._invalid_blocks.update(lost)
        self.stats.count(common.LOAD_FAILED_CHUNKS, len(chunks) - done)
        if pool_ok:
            self.guard.log.warning(
                "load-miss",
                "maru pool: %d of %d chunk(s) could not be loaded; vLLM recomputes %d block(s)",
                len(chunks) - done,
                len(chunks),
                len(lost),
            )
        return False

    def _load_chunk(self, chunk: ChunkLoad, pin) -> bool:
        assert self.paged is not None
        try:
            pin.verify()
            src = self.paged.chunk_view(pin.buffer, self.blocks_per_chunk)
            self.paged.scatter(src, chunk.slots)
            del src  # the pin's view must have no exports left when it is released
            return True
        except Exception as err:  # a corrupt or odd-sized chunk is a failed load, not an engine error
            if type(err).__name__ == "ChecksumMismatch":
                self.stats.count(common.CHECKSUM_MISMATCHES)
            self.guard.log.warning(
                f"load-{type(err).__name__}",
                "maru pool: chunk %s unusable (%s: %s); recomputing it",
                chunk.keys[self.tp_rank].hex()[:16],
                type(err).__name__,
                err,
            )
            return False

    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    # ------------------------------------------------------------------ saves

    def save(self, meta: MaruConnectorMetadata, skip_requests: set[str] = frozenset()) -> None:
        """Store the step's completed chunks: lease all in one call, copy, commit all in one call.

        ``skip_requests`` are requests whose load failed this step: their freshly computed KV sat
        on top of bad blocks, so it must not reach the pool.
        """
        if not meta.saves or self.paged is None:
            return
        chunks = [c for req_id, cs in meta.saves.items() if req_id not in skip_requests for c in cs]
        if not chunks:
            return
        nbytes = self.paged.geometry(self.blocks_per_chunk).chunk_bytes
        ok, leases = self.guard.call(
            "save", lambda c, items: c.begin_write_many(items), [(ch.keys[self.tp_rank], nbytes) for ch in chunks]
        )
        if not ok or leases is None:
            self.stats.count(common.SAVE_SKIPPED_CHUNKS, len(chunks))
            return
        written = []
        try:
            for chunk, lease in zip(chunks, leases, strict=True):
                if lease is None:
                    self.stats.count(common.SAVE_NOT_LEASED)
                    continue
                out = self.paged.chunk_view(lease.buffer, self.blocks_per_chunk)
                self.paged.gather(chunk.block_ids, out)
                del out
                written.append(lease)
        except Exception as err:  # never into vLLM; unwritten leases are aborted below
            self.guard.failed("save-copy", err)
        leftover = [lease for lease in leases if lease is not None and lease not in written]
        if leftover:
            self.guard.call("save-abort", lambda c, ls: c.abort_many(ls), leftover)
        if not written:
            return
        ok, committed = self.guard.call("save-commit", lambda c, ls: c.commit_many(ls), written)
        stored = sum(1 for x in committed or () if x) if ok else 0
        self.stats.count(common.SAVED_CHUNKS, stored)
        self.stats.count(common.SAVE_SKIPPED_CHUNKS, len(written) - stored)

    def shutdown(self) -> None:
        self.guard.close()
