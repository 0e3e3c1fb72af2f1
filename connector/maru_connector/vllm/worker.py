"""Worker half of the Maru connector: copies KV blocks between the engine and the pool mapping.

Runs in each model worker (one per TP rank). Copies run on two background lanes (``lane.Lane``),
so the engine's thread only plans them:

* **Loads** (asynchronous, vLLM's ``load_kv_async``): ``start_load_kv`` hands the step's loads to
  the load lane; the request waits in ``WAITING_FOR_REMOTE_KVS`` meanwhile, and ``get_finished``
  reports it loaded once its copy is done, together with any blocks that failed (vLLM recomputes
  them before the request computes anything). With ``maru_load_async: false`` loads run inside
  ``start_load_kv``, before the forward that reads them.
* **Saves**: ``wait_for_save`` hands the chunks the step completed to the save lane. Their blocks
  stay valid until the copy is done: a running request does not change full blocks; a finished one
  keeps them (``request_finished`` delays the free until the scheduler half, having heard every
  save's outcome, lists the request in ``MaruConnectorMetadata.free_now``, which the worker echoes
  as ``finished_sending`` once its own lane is done with it); a preempted one is waited for in
  ``handle_preemptions``, before the step that could reuse its blocks.

All copying of engine memory goes through ``layout.PagedKV``, the one place that knows where KV
bytes sit. Pool traffic per job: one batched call to pin or lease, one to release or commit, whatever
the number of layers. Pool memory is read and written exactly once per chunk, and checksummed in
the same pass, so bytes that changed in the pool behind our back can only ever fail a checksum. On
CPU engines with dense pages (``PagedKV.direct``) the copy goes straight between the engine's pages
and the pool, each byte copied once: a load that fails its checksum has already written its blocks,
which are then reported failed and recomputed by vLLM before anything reads them. Otherwise (GPU
caches, split pages) it goes through a staging buffer per lane: a load copies the chunk out and
verifies that copy before it touches the engine, and a save checksums the engine's bytes while it
copies them in. Leases and pins about to expire are renewed between chunks.

What became of each load and save goes back to the scheduler half in :meth:`MaruWorker.report`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from maru_connector.layout import KVLayoutError, PagedKV, describe_kv_caches
from maru_connector.staging import StagedCopier
from maru_connector.vllm import common
from maru_connector.vllm.kvspec import is_latent_cache, refuse_unsupported_kv_cache, total_kv_heads
from maru_connector.vllm.lane import Job, Lane
from maru_connector.vllm.metadata import (
    ORPHAN,
    PRESENT,
    RETRY,
    SEVERITY,
    SKIPPED,
    STORED,
    TAINTED,
    ChunkLoad,
    ChunkSave,
    LoadPlan,
    MaruConnectorMetadata,
    MaruWorkerInfo,
    MaruWorkerReport,
)
from maru_connector.vllm.namespace import kv_layers_digest
from maru_contracts.config import MaruConnectorConfig
from maru_contracts.keys import RankHeads, rank_heads
from maru_pool.client import fill_segments_many, read_segments_many

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Renew a lease or pin when less than this share of its period is left before the next chunk's copy.
RENEW_BELOW_SHARE = 0.5
# Direct copies go in one call (the GIL released once) per this many bytes; leases are renewed between.
COPY_GROUP_BYTES = 256 << 20
# A step's saves are skipped (SKIPPED, counted) while this many steps' saves wait on the save lane:
# a pool slower than the engine then costs stores, not memory and ever longer waits.
SAVE_LANE_MAX_QUEUED = 4
# A copy job not started this long after its step is given up: loads are reported failed (vLLM
# recomputes), saves skipped.
JOB_DEADLINE_S = 30.0


@dataclass(frozen=True)
class LoadOutcome:
    """What one request's load came to (built on the load lane, applied on the engine's thread)."""

    req_id: str
    load_id: int
    failed_from: int  # index of the first chunk that failed, -1 when all loaded
    lost_blocks: frozenset[int]  # destination blocks that hold no valid KV
    asynchronous: bool


# (req_id, chunk index, outcome) for one chunk handed over for saving.
SaveOutcome = tuple[str, int, str]
# (req_id, chunk index, ChunkSave) still to be stored.
SaveItem = tuple[str, int, ChunkSave]


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
        tp_group: Any = None,
    ) -> None:
        """``tp_group`` is vLLM's tensor-parallel GroupCoordinator (None: a single rank)."""
        self.cfg = cfg
        self.loads_enabled = loads
        self.saves_enabled = saves
        self.tp_rank = tp_rank
        self._tp_group = tp_group
        refuse_unsupported_kv_cache(vllm_config, kv_cache_config)  # before the block size: see kvspec
        # An MLA latent is the same on every rank: every rank loads the one copy (key 0), rank 0 alone
        # stores it (the others would write the same bytes again under the same key). Paged K/V is keyed
        # by the KV heads a rank holds: replicas of a range store it once, and a rank of another TP size
        # than the writer's reads the stored ranges overlapping its heads and copies those in.
        self.latent = is_latent_cache(kv_cache_config)
        self.heads = worker_heads(vllm_config, kv_cache_config, cfg, tp_rank, latent=self.latent)
        self.key_rank = self.heads.store_key
        self.stores = self.heads.stores
        self.block_size = vllm_config.cache_config.block_size
        cfg.check_block_size(self.block_size)
        self.blocks_per_chunk = cfg.chunk_tokens // self.block_size
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.paged: PagedKV | None = None
        # With several KV cache groups, each group's layers on their own (chunks name their group), and
        # per group a (load, save) pair of staging buffers where copies are staged.
        self._group_pages: list[PagedKV] = []
        self._group_staging: list[tuple[StagedCopier, StagedCopier]] = []
        # Set by a sleep (vLLM 0.33): the KV cache is never used with the pool again (unregister_kv_caches).
        self._slept = False
        self._said_off_after_sleep = False
        # One staging buffer per lane: each lane copies one chunk at a time.
        self._load_staging: StagedCopier | None = None
        self._save_staging: StagedCopier | None = None
        self.stats = common.Counters()
        self.guard = common.PoolGuard(cfg, f"worker{tp_rank}", self.stats)
        self._hook_log = common.RateLimitedLog()
        self._loads = Lane(f"worker{tp_rank}-loads", self._hook_log, self.stats)
        self._saves = Lane(f"worker{tp_rank}-saves", self._hook_log, self.stats)
        # Destination block ids whose load failed since the last report to vLLM.
        self.invalid_blocks: set[int] = set()
        # Load ids that failed and are not yet settled on the scheduler side (saves may depend on them).
        self._failed_loads: set[int] = set()
        # Requests whose asynchronous load finished (loaded or not) since the last get_finished.
        self._loaded: set[str] = set()
        # Of those, the ones whose load failed, with several KV cache groups: vLLM then takes failures
        # per request (failed_recving) and recomputes the prompt, never per block (it cannot map block
        # ids back to a request's groups, and raises).
        self.failed_recving: set[str] = set()
        # Requests the scheduler half let go of whose save jobs here are not done yet.
        self._to_free: set[str] = set()
        self._report = MaruWorkerReport()

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Recognise the engine's KV cache once, at start; one this connector cannot copy raises ``KVLayoutError``."""
        if self._slept:
            self.restore_kv_caches()  # registered again after a sleep: stay off the pool all the same
            return
        # One group of paged attention KV: the constructor refused every other kind (kvspec).
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        paged = describe_kv_caches(
            kv_caches,
            num_blocks=self._kv_cache_config.num_blocks,
            block_size=self.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            backend=attention_backend(self._vllm_config, list(kv_caches)),
            latent=self.latent,
        )
        chunk_bytes = paged.geometry(self.blocks_per_chunk).chunk_bytes
        if not paged.direct:  # direct copies (CPU, dense pages) need no staging
            self._load_staging = StagedCopier(paged, self.blocks_per_chunk)
            self._save_staging = StagedCopier(paged, self.blocks_per_chunk)
        for lane in (self._loads, self._saves):
            lane.use_device(paged.device)  # the lanes' streams and events are the rank's device's
        self._group_pages = self._describe_groups(kv_caches, paged)
        if not paged.direct and self._group_pages:
            # A group's chunk holds its layers only: a staging buffer of its own size and layout.
            self._group_staging = [
                (StagedCopier(pages, self.blocks_per_chunk), StagedCopier(pages, self.blocks_per_chunk))
                for pages in self._group_pages
            ]
            self._load_staging, self._save_staging = self._group_staging[0]
        self.paged = paged
        common.log.info(
            "maru worker %d: KV %s (layout %s), %d layers, %d bytes per block per layer, chunk %d bytes",
            self.tp_rank,
            paged.format,
            getattr(self._kv_cache_config, "kv_cache_layout", None) or "?",
            paged.num_layers,
            paged.block_bytes,
            chunk_bytes,
        )

    def _describe_groups(self, kv_caches: dict[str, torch.Tensor], paged: PagedKV) -> list[PagedKV]:
        """Each KV cache group's layers, when there are several: a group's chunk holds its layers only."""
        groups = self._kv_cache_config.kv_cache_groups
        if len(groups) == 1:
            return []
        out = []
        for group in groups:
            caches = {name: kv_caches[name] for name in group.layer_names}
            out.append(
                describe_kv_caches(
                    caches,
                    num_blocks=self._kv_cache_config.num_blocks,
                    block_size=self.block_size,
                    num_kv_heads=group.kv_cache_spec.num_kv_heads,
                    head_size=group.kv_cache_spec.head_size,
                    backend=attention_backend(self._vllm_config, list(caches)),
                    latent=self.latent,
                )
            )
        return out

    def _staging(self, group: int, *, save: bool) -> StagedCopier | None:
        """The staging buffer a chunk of KV cache group ``group`` is loaded (or saved) through."""
        if self._group_staging:
            return self._group_staging[group][save]
        return self._save_staging if save else self._load_staging

    def _load_stagings(self) -> list[StagedCopier]:
        if self._group_staging:
            return [load for load, _ in self._group_staging]
        return [self._load_staging] if self._load_staging is not None else []

    def _pages(self, group: int) -> PagedKV | None:
        """The pages a chunk of KV cache group ``group`` is copied from and to."""
        return self._group_pages[group] if self._group_pages else self.paged

    def unregister_kv_caches(self) -> None:
        """The engine is about to free or offload its KV cache (sleep mode): stop touching it, for good.

        Sleep is mostly used to reload weights (RL), which the connector cannot see: the chunk keys
        name the weights identity computed at start, so after a wake-up this engine's KV may belong
        under other keys. It neither loads nor stores again until it restarts.
        """
        self.wait_idle()  # the lanes' copies in flight still read the cache
        self.paged = None
        self._slept = True

    def restore_kv_caches(self) -> None:
        """The KV cache is back (wake up): stay off the pool (see :meth:`unregister_kv_caches`)."""
        if self._slept and not self._said_off_after_sleep:
            self._said_off_after_sleep = True
            common.log.warning(
                "maru worker %d: woke up from sleep; the weights may have been reloaded and the chunk keys "
                "name the ones it started with, so this engine stops using the pool until it restarts",
                self.tp_rank,
            )

    def handshake(self) -> MaruWorkerInfo | None:
        if self.paged is None:
            return None
        return MaruWorkerInfo(
            kv_format=self.paged.format,
            tp_rank=self.tp_rank,
            block_bytes=self.paged.block_bytes,
            num_layers=self.paged.num_layers,
            # Per head: engines of another TP size hold other head counts of the same layers.
            kv_layers=kv_layers_digest(self.paged.layer_names, self.paged.block_bytes // self.paged.heads),
        )

    # ------------------------------------------------------------------ loads

    def load(self, meta: MaruConnectorMetadata) -> None:
        """Start the step's loads: on the load lane (asynchronous plans), or here (the others).

        A chunk that is missing (evicted since the lookup), unreadable or fails its checksum marks its
        destination blocks, and those of every later chunk of the request, as failed; vLLM then
        recomputes from the first failed block (kv_load_failure_policy=recompute).
        """
        self._forget_settled(meta.settled_below)
        if not meta.loads:
            return
        plans = list(meta.loads.items())
        now = [(r, p) for r, p in plans if not p.asynchronous]
        later = [(r, p) for r, p in plans if p.asynchronous]
        # Loads overwrite blocks: their copies wait for the work queued so far on the engine's stream.
        after = self.paged.mark() if self.paged is not None else None
        if now:
            self._apply_loads(self._copy_in(now, after))
        if later:
            self._loads.submit(
                Job(
                    run=lambda: self._copy_in(later, after),
                    req_ids=frozenset(r for r, _ in later),
                    on_error=lambda _err: [_failed_load(r, p) for r, p in later],
                    deadline=time.monotonic() + JOB_DEADLINE_S,
                )
            )

    def fail_loads(self, meta: MaruConnectorMetadata) -> None:
        """``load`` raised: report every block this step was to load as failed, so vLLM recomputes them."""
        self._apply_loads(
            [_failed_load(r, p) for r, p in meta.loads.items() if self._report.loads.get(p.load_id, -1) < 0]
        )

    def _copy_in(self, plans: list[tuple[str, LoadPlan]], after: torch.cuda.Event | None = None) -> list[LoadOutcome]:
        """Pin every chunk of ``plans`` in one round trip, copy them in, release them in one.

        ``after``: the engine stream's event (``PagedKV.mark``) the copies into the cache wait for.
        """
        started = time.monotonic()
        for staging in self._load_stagings():
            staging.after(after)
        chunks = [chunk for _, plan in plans for chunk in plan.chunks]
        # Each chunk's stored pieces: the one whole chunk at equal TP, else every overlapping head range.
        keys = [chunk.keys[i] for chunk in chunks for i, _ in self.heads.reads]
        pins: list = [None] * len(keys)
        pool_ok = True
        if chunks and self.paged is not None:
            pool_ok, got = self.guard.call("load", lambda c, ks: c.open_read_many(ks), keys)
            pins = got if pool_ok and got is not None else pins
        outcomes = []
        try:
            copied = self._copy_chunks(chunks, pins) if self.heads.whole else self._reshard_chunks(chunks, pins)
            at = 0
            for req_id, plan in plans:
                outcomes.append(self._load_plan(req_id, plan, copied[at : at + len(plan.chunks)], pool_ok=pool_ok))
                at += len(plan.chunks)
        finally:
            held = [p for p in pins if p is not None]
            if held:
                self.guard.call("release", lambda c, ps: c.release_many(ps), held)
        for staging in self._load_stagings():
            staging.finish()  # scatters queued on the lane's stream have landed
        if chunks:
            self.stats.observe(common.LOAD_SECONDS, time.monotonic() - started)
        return outcomes

    def _load_plan(self, req_id: str, plan: LoadPlan, copied: list[bool], *, pool_ok: bool) -> LoadOutcome:
        """One request's outcome: its chunks up to the first one that did not land verified."""
        done = 0
        if not plan.fail_blocks:
            while done < len(copied) and copied[done]:
                done += 1
        self.stats.count(common.LOADED_CHUNKS, done)
        if done == len(plan.chunks) and not plan.fail_blocks:
            return LoadOutcome(req_id, plan.load_id, -1, frozenset(), plan.asynchronous)
        lost = frozenset(d for chunk in plan.chunks[done:] for _, d in chunk.slots) | frozenset(plan.fail_blocks)
        self.stats.count(common.LOAD_FAILED_CHUNKS, len(plan.chunks) - done)
        if pool_ok and not plan.fail_blocks:
            self.guard.log.warning(
                "load-miss",
                "maru pool: %d of %d chunk(s) could not be loaded; vLLM recomputes %d block(s)",
                len(plan.chunks) - done,
                len(plan.chunks),
                len(lost),
            )
        return LoadOutcome(req_id, plan.load_id, done, lost, plan.asynchronous)

    def _copy_chunks(self, chunks: list[ChunkLoad], pins: list) -> list[bool]:
        """Copy every pinned chunk into its blocks; per chunk, whether it landed verified.

        Straight into the engine's pages in one pass over all of them when the pages allow it (a
        chunk that fails its checksum has then written its blocks, which the caller reports failed);
        else chunk by chunk through the staging buffer.
        """
        paged = self.paged
        copied = [False] * len(chunks)
        held = [p for p in pins if p is not None]
        if paged is None or not held:
            return copied
        todo = [i for i, pin in enumerate(pins) if pin is not None]
        try:
            if paged.direct:
                for group in _groups(todo, pins[todo[0]].nbytes):
                    self._keep_alive(pins[group[0]], held)
                    segments = [self._pages(chunks[i].group).segments(self._targets(chunks[i])) for i in group]
                    for i, good in zip(group, read_segments_many([pins[i] for i in group], segments), strict=True):
                        copied[i] = good
                        if not good:
                            self._unusable(chunks[i], "ChecksumMismatch" if pins[i].corrupt else "LeaseLost")
                return copied
            for i in todo:
                copied[i] = self._load_staged(chunks[i], pins[i], held)
        except Exception as err:  # a bug or a bad chunk is a failed load, not an engine error
            self._unusable(chunks[todo[0]], type(err).__name__, err)
        return copied

    def _reshard_chunks(self, chunks: list[ChunkLoad], pins: list) -> list[bool]:
        """Copy in every chunk whose head ranges are all pinned, re-sharded to this rank's heads.

        Each stored piece is read into host memory and verified there, the pieces' overlap with this
        rank's heads is joined into this rank's chunk (``PagedKV.reshard``), and that is scattered into
        the blocks: the engine only ever sees verified bytes.
        """
        paged = self.paged
        per = len(self.heads.reads)
        copied = [False] * len(chunks)
        held = [p for p in pins if p is not None]
        if paged is None or not held:
            return copied
        assert self.heads.heads is not None  # a latent is always whole
        for i, chunk in enumerate(chunks):
            mine = pins[i * per : (i + 1) * per]
            if any(pin is None for pin in mine):
                continue  # a missing piece: this chunk and those after it are recomputed
            try:
                pieces = []
                for pin, (_, heads) in zip(mine, self.heads.reads, strict=True):
                    self._keep_alive(pin, held)
                    buf = bytearray(pin.nbytes)
                    pin.read_into(buf)  # verified: a changed piece raises ChecksumMismatch
                    pieces.append((heads, buf))
                pages = self._pages(chunk.group)
                assert pages is not None
                joined = pages.reshard(pieces, self.heads.heads, self.blocks_per_chunk)
                if self._load_staging is None:  # dense CPU pages: a plain copy, done when it returns
                    pages.scatter(joined, chunk.slots)
                else:  # on the load stream, ordered and fenced like every other staged load
                    flat = joined.reshape(-1)
                    staging = self._staging(chunk.group, save=False)
                    assert staging is not None
                    staging.scatter(lambda host, f=flat: torch.from_numpy(host).copy_(f), chunk.slots)
                copied[i] = True
            except Exception as err:  # a corrupt or odd-sized piece is a failed load, not an engine error
                self._unusable(chunk, type(err).__name__, err)
        return copied

    def _targets(self, chunk: ChunkLoad) -> list[int | None]:
        """The chunk's destination block per block in the chunk (None: not wanted, hashed only)."""
        targets: list[int | None] = [None] * self.blocks_per_chunk
        for in_chunk, block_id in chunk.slots:
            targets[in_chunk] = block_id
        return targets

    def _load_staged(self, chunk: ChunkLoad, pin, held: list) -> bool:
        paged, staging = self._pages(chunk.group), self._staging(chunk.group, save=False)
        assert paged is not None and staging is not None
        try:
            self._keep_alive(pin, held)
            expected = paged.geometry(self.blocks_per_chunk).chunk_bytes
            if pin.nbytes != expected:
                # As on the direct path: a chunk of another size is not this engine's chunk, and a short
                # one would leave the staging buffer's stale tail to be scattered into the blocks.
                raise ValueError(f"the chunk holds {pin.nbytes} bytes, this engine's chunk is {expected}")
            # One read of pool memory: copy out and verify that copy; the engine only sees verified bytes.
            staging.scatter(pin.read_into, chunk.slots)
            return True
        except Exception as err:  # a corrupt or odd-sized chunk is a failed load, not an engine error
            self._unusable(chunk, type(err).__name__, err)
            return False

    def _unusable(self, chunk: ChunkLoad, why: str, err: object = "") -> None:
        if why == "ChecksumMismatch":
            self.stats.count(common.CHECKSUM_MISMATCHES)
        self.guard.log.warning(
            f"load-{why}",
            "maru pool: chunk %s unusable (%s%s); recomputing it",
            chunk.keys[self.heads.reads[0][0]].hex()[:16],
            why,
            f": {err}" if err else "",
        )

    def _apply_loads(self, outcomes: Iterable[LoadOutcome]) -> None:
        """Record load outcomes for vLLM (failed blocks, finished requests) and the scheduler half."""
        for out in outcomes:
            self._report.loads[out.load_id] = out.failed_from
            if out.failed_from >= 0:
                self._failed_loads.add(out.load_id)
                if self._group_pages and out.asynchronous:
                    self.failed_recving.add(out.req_id)
                else:
                    self.invalid_blocks.update(out.lost_blocks)
            if out.asynchronous:
                self._loaded.add(out.req_id)

    def take_failed_recving(self) -> set[str]:
        out, self.failed_recving = self.failed_recving, set()
        return out

    def take_invalid_blocks(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    # ------------------------------------------------------------------ saves

    def save(self, meta: MaruConnectorMetadata) -> None:
        """Hand the step's completed chunks to the save lane: lease all in one call, copy, commit all in one.

        A request whose KV was computed over a load that failed (in this step, or in an earlier
        one the scheduler had not heard of when it planned this one) stores nothing: its chunks are
        reported TAINTED and saved again once vLLM has recomputed them.
        """
        if not meta.saves:
            return
        # First, and on every rank alike: a collective must not be skipped by one rank's early return.
        failed = self._failed_on_any_rank(meta)
        todo: list[SaveItem] = []
        for req_id, plan in meta.saves.items():
            if failed.intersection(plan.depends_on):
                self._outcome(req_id, [c.index for c in plan.chunks], TAINTED)
                self.stats.count(common.SAVE_TAINTED_CHUNKS, len(plan.chunks))
                continue
            todo += [(req_id, c.index, c) for c in plan.chunks]
        if not todo or not self.stores:
            return  # another rank stores this rank's (identical) latent and reports on it
        paged = self.paged
        if paged is None or self.guard.backing_off():
            # Nothing to try: a dead pool is not asked again before its back-off ends.
            if paged is not None:
                self.stats.count(common.POOL_SKIPPED_CALLS)
            self._apply_saves(self._skip(todo, SKIPPED))
            return
        if self._saves.queued() >= SAVE_LANE_MAX_QUEUED:
            self.stats.count(common.SAVE_BEHIND_CHUNKS, len(todo))
            self._apply_saves(self._skip(todo, SKIPPED))
            return
        ready = paged.fence()  # the copy must see what this step's forward computed
        self._saves.submit(
            Job(
                run=lambda: self._copy_out(todo, ready),
                req_ids=frozenset(r for r, _, _ in todo),
                on_error=lambda _err: self._skip(todo, SKIPPED),
                deadline=time.monotonic() + JOB_DEADLINE_S,
            )
        )

    def skip_saves(self, meta: MaruConnectorMetadata) -> None:
        """``save`` raised: whatever it did not report or hand over is to be tried again."""
        handed = self._saves.busy_with(meta.saves)
        todo = [(r, c.index, c) for r, plan in meta.saves.items() if r not in handed for c in plan.chunks]
        self._apply_saves(self._skip([t for t in todo if (t[0], t[1]) not in self._report.saves], SKIPPED))

    def _copy_out(self, todo: list[SaveItem], ready: Callable[[], None]) -> list[SaveOutcome]:
        """Store ``todo`` on the save lane; returns every chunk's outcome."""
        started = time.monotonic()
        try:
            return self._store(todo, ready)
        finally:
            self.stats.observe(common.SAVE_SECONDS, time.monotonic() - started)

    def _store(self, todo: list[SaveItem], ready: Callable[[], None]) -> list[SaveOutcome]:
        """Store ``todo``; one outcome per chunk: with several KV cache groups, the worst of its parts
        (a chunk is stored once every group's part is, as across TP ranks)."""
        worst: dict[tuple[str, int], str] = {}
        for req_id, index, outcome in self._store_parts(todo, ready):
            mine = worst.get((req_id, index))
            if mine is None or SEVERITY[outcome] > SEVERITY[mine]:
                worst[(req_id, index)] = outcome
        return [(req_id, index, outcome) for (req_id, index), outcome in worst.items()]

    def _store_parts(self, todo: list[SaveItem], ready: Callable[[], None]) -> list[SaveOutcome]:
        paged = self.paged
        if paged is None:
            return self._skip(todo)
        sizes = [self._chunk_bytes(c.group) for _, _, c in todo]
        nbytes = max(sizes)
        items = [
            (c.keys[self.key_rank], size, c.parents[self.key_rank], c.token_ids)
            for (_, _, c), size in zip(todo, sizes, strict=True)
        ]
        ok, leases = self.guard.call("save", lambda c, its: c.lease_many(its), items)
        if not ok or leases is None:
            return self._skip(todo, SKIPPED)
        out: list[SaveOutcome] = []
        written: list[tuple[str, int, Any]] = []
        answered: set[int] = set()  # positions in todo with an outcome already
        try:
            ready()
            granted: list[tuple[str, int, ChunkSave, Any]] = []
            for at, ((req_id, index, chunk), lease) in enumerate(zip(todo, leases, strict=True)):
                if lease == PRESENT:
                    self.stats.count(common.SAVE_NOT_LEASED)
                    out.append((req_id, index, PRESENT))
                    answered.add(at)
                elif isinstance(lease, str):  # full, or the chunk before it is not stored
                    self.stats.count(common.SAVE_SKIPPED_CHUNKS)
                    out.append((req_id, index, ORPHAN if lease == ORPHAN else RETRY))
                    answered.add(at)
                else:
                    granted.append((req_id, index, chunk, lease))
            live = [g[3] for g in granted]
            if paged.direct:
                # The engine's pages straight into the pool, many chunks per pass, checksummed on the way.
                for group in _groups(granted, nbytes):
                    self._keep_alive(group[0][3], live)
                    segments = [self._pages(chunk.group).segments(chunk.block_ids) for _, _, chunk, _ in group]
                    filled = fill_segments_many([g[3] for g in group], segments)
                    written += [(r, i, lease) for (r, i, _, lease), ok in zip(group, filled, strict=True) if ok]
            else:
                for group in sorted({chunk.group for _, _, chunk, _ in granted}):
                    mine = [g for g in granted if g[2].group == group]
                    staging = self._staging(group, save=True)
                    assert staging is not None
                    packed = staging.gathered([chunk.block_ids for _, _, chunk, _ in mine])
                    for (req_id, index, _, lease), host in zip(mine, packed, strict=True):
                        self._keep_alive(lease, live)
                        lease.fill(host)  # checksums the engine's bytes, not the pool's
                        written.append((req_id, index, lease))
        except Exception as err:  # never into vLLM; unwritten leases are aborted below
            self.guard.failed("save-copy", err)
        done = {id(lease) for _, _, lease in written}
        leftover = [x for x in leases if not isinstance(x, str) and id(x) not in done]
        if leftover:
            self.guard.call("save-abort", lambda c, ls: c.abort_many(ls), leftover)
        # By position: with several KV cache groups a chunk index comes once per group.
        answered |= {at for at, lease in enumerate(leases) if id(lease) in done}
        out += self._skip([t for at, t in enumerate(todo) if at not in answered])
        if not written:
            return out
        ok, committed = self.guard.call("save-commit", lambda c, ls: c.commit_many(ls), [w[2] for w in written])
        results = committed if ok and committed is not None else [False] * len(written)
        for (req_id, index, _), stored in zip(written, results, strict=True):
            out.append((req_id, index, STORED if stored else RETRY))
        stored = sum(1 for x in results if x)
        self.stats.count(common.SAVED_CHUNKS, stored)
        self.stats.count(common.SAVE_SKIPPED_CHUNKS, len(written) - stored)
        return out

    def _skip(self, todo: list[SaveItem], outcome: str = RETRY) -> list[SaveOutcome]:
        self.stats.count(common.SAVE_SKIPPED_CHUNKS, len(todo))
        return [(req_id, index, outcome) for req_id, index, _ in todo]

    def _apply_saves(self, outcomes: Iterable[SaveOutcome]) -> None:
        for req_id, index, outcome in outcomes:
            self._report.saves[(req_id, index)] = outcome

    def _chunk_bytes(self, group: int) -> int:
        pages = self._pages(group)
        assert pages is not None
        return pages.geometry(self.blocks_per_chunk).chunk_bytes

    # ------------------------------------------------------------------ step boundaries

    def handle_preemptions(self, meta: MaruConnectorMetadata) -> None:
        """Before a step that may reuse preempted requests' blocks: finish the saves reading them."""
        if meta.preempted:
            # Saves not started have read nothing: give them up (SKIPPED) rather than wait behind
            # every job queued before them. A copy already running reads the blocks: it is waited
            # for, and its own pool calls are bounded by the RPC timeout.
            self._saves.drop(meta.preempted)
            self._saves.wait_for(meta.preempted)
        if meta.window_frees:
            # Sliding-window blocks vLLM freed at this step's scheduling may be written by its forward:
            # the saves reading them finish first (not dropped: the chunk is stored all the same).
            self._saves.wait_for(meta.window_frees)

    def finished(self, meta: MaruConnectorMetadata | None) -> tuple[set[str], set[str]]:
        """Collect the lanes' results; ``(requests whose blocks may be freed, requests loaded)``.

        vLLM's ``get_finished``, once per step after ``wait_for_save``: what it reports here and in
        the step's ``get_block_ids_with_load_errors`` and ``report`` arrives at the scheduler together.
        """
        self._collect()
        loaded, self._loaded = self._loaded, set()
        if meta is not None:
            self._to_free.update(meta.free_now)
        # Neither lane may still be touching a released request's blocks.
        busy = self._saves.busy_with(self._to_free) | self._loads.busy_with(self._to_free)
        freed = self._to_free - busy
        self._to_free = busy
        return freed, loaded

    def finished_degraded(self) -> set[str]:
        """``finished`` raised: still hand vLLM the requests whose loads are done, so none waits forever
        for a report; releases wait for a call that works."""
        self._collect()
        loaded, self._loaded = self._loaded, set()
        return loaded

    def report(self) -> MaruWorkerReport | None:
        """This step's outcomes for the scheduler half (vLLM's ``build_connector_worker_meta``)."""
        out, self._report = self._report, MaruWorkerReport()
        return None if out.is_empty() else out

    def wait_idle(self) -> None:
        """Block until both lanes are idle (their results are collected on the next step)."""
        self._loads.wait_for()
        self._saves.wait_for()

    def shutdown(self) -> None:
        self._loads.close()
        self._saves.close()
        self.guard.close()

    # ------------------------------------------------------------------ internals

    def _collect(self) -> None:
        for outcomes in self._loads.take_done():
            self._apply_loads(outcomes)
        for outcomes in self._saves.take_done():
            self._apply_saves(outcomes)

    def _failed_on_any_rank(self, meta: MaruConnectorMetadata) -> set[int]:
        """Which of the loads the step's saves depend on failed, on this rank or any other.

        Tensor-parallel ranks sum their partial results after every layer, so KV computed over a
        load that failed on one rank is wrong on all of them: every rank must drop it. One small
        all-reduce on the CPU group, only in steps whose saves depend on unsettled loads.
        """
        # From the step's metadata, the same on every rank: if this raises, no rank joins the collective.
        deps = sorted({load_id for plan in meta.saves.values() for load_id in plan.depends_on})
        if not deps:
            return set()
        try:
            flags = torch.tensor([int(load_id in self._failed_loads) for load_id in deps], dtype=torch.int32)
        except Exception as err:
            # This rank's own state broke: it still joins the all-reduce below, or the other ranks wait
            # in it forever, and says "failed" for every load, so that every rank drops these saves
            # (stored again later, once nothing they depend on is unsettled).
            common.hook_failed(
                self.stats, self.guard.log, "wait_for_save (failed-load check)", err,
                "the step's saves that depend on unsettled loads are dropped on every rank",
            )  # fmt: skip
            flags = torch.ones(len(deps), dtype=torch.int32)
        group = self._tp_group
        if group is not None and getattr(group, "world_size", 1) > 1:
            torch.distributed.all_reduce(flags, group=group.cpu_group)
        return {load_id for load_id, n in zip(deps, flags.tolist(), strict=True) if n}

    def _outcome(self, req_id: str, chunks: list[int], outcome: str) -> None:
        for index in chunks:
            self._report.saves[(req_id, index)] = outcome

    def _keep_alive(self, item, held: list) -> None:
        """Renew the job's leases or pins if ``item``'s is running out before its copy."""
        lease_s = getattr(item, "lease_s", float("inf"))
        if item.remaining() < lease_s * RENEW_BELOW_SHARE:
            live = [x for x in held if x is not None and not isinstance(x, str) and not x.done]
            self.guard.call("renew", lambda c, xs: c.keep_alive(xs, min_left_s=lease_s * RENEW_BELOW_SHARE), live)

    def _forget_settled(self, settled_below: int) -> None:
        if self._failed_loads:
            self._failed_loads = {x for x in self._failed_loads if x >= settled_below}


def _groups(items: list, item_bytes: int) -> list[list]:
    """``items`` in runs of at most :data:`COPY_GROUP_BYTES` (at least one item each)."""
    per_group = max(1, COPY_GROUP_BYTES // max(1, item_bytes))
    return [items[i : i + per_group] for i in range(0, len(items), per_group)]


def _failed_load(req_id: str, plan: LoadPlan) -> LoadOutcome:
    lost = frozenset(plan.fail_blocks) | frozenset(d for chunk in plan.chunks for _, d in chunk.slots)
    return LoadOutcome(req_id, plan.load_id, 0, lost, plan.asynchronous)


def worker_heads(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: MaruConnectorConfig, tp_rank: int, *, latent: bool
) -> RankHeads:
    """This rank's KV heads and keys, checked against the heads its KV cache holds."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    total = total_kv_heads(vllm_config, cfg.writer_tp, latent=latent)
    heads = rank_heads(total, tp_size, tp_rank, cfg.writer_tp)
    local = kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads
    if heads.heads is not None and heads.heads[1] - heads.heads[0] != local:
        raise KVLayoutError(
            f"rank {tp_rank} of TP {tp_size} should hold KV heads {heads.heads} of {total}, but its KV cache "
            f"has {local}: the chunk keys would name the wrong heads"
        )
    return heads


def attention_backend(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    """The name of the attention backend that reads these layers' KV (it decides what the bytes mean)."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    names = set()
    for layer_name in layer_names:
        backend = getattr(context.get(layer_name), "attn_backend", None)
        if backend is not None:
            names.add(backend.get_name())
    if len(names) != 1:
        raise KVLayoutError(
            f"cannot tell which attention backend reads the KV cache (found {sorted(names) or 'none'} for "
            f"layers {layer_names[:3]}...); the chunk keys must name it"
        )
    return names.pop()
