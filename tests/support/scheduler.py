"""The connector's scheduler half with vLLM's own config objects: a scheduler, the keys it must compute for a
request, and its lookups asked until they answer."""

from __future__ import annotations

import time

from maru_connector.vllm.metadata import (
    MaruWorkerInfo,
)
from maru_connector.vllm.scheduler import MaruScheduler
from maru_contracts.config import MaruConnectorConfig
from maru_contracts.keys import Namespace, chunk_keys
from tests.connector import fakes
from tests.connector.fakes import BLOCK, CHUNK

NO_POOL = "unix:///nonexistent/maru/pool.sock"

INFO = dict(kv_format="CPU_ATTN:HNC:float32", block_bytes=1, num_layers=2, kv_layers="layers")


def make(
    url: str = NO_POOL, *, loads: bool = True, saves: bool = True, hash_algo: str = "sha256", **extra_config: object
) -> MaruScheduler:

    extra = {"maru_pool_url": url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": 5000}
    extra |= {f"maru_{k}": v for k, v in extra_config.items()}
    cfg = MaruConnectorConfig.from_extra_config(extra)
    sched = MaruScheduler(
        fakes.vllm_config(hash_algo=hash_algo), fakes.kv_cache_config(), cfg, loads=loads, saves=saves
    )
    sched.set_worker_info({0: MaruWorkerInfo(tp_rank=0, **INFO)})
    return sched


def expected_keys(req: fakes.Request) -> list[bytes]:
    import vllm

    ns = Namespace(
        model="tiny-llama",
        revision="",
        weights="unresolved:tiny-llama@default",
        load_format="auto",
        loader_config="{}",
        model_impl="auto",
        quantization="",
        hf_overrides="{}",
        dtype="torch.float32",
        kv_cache_dtype="auto",
        kv_format=INFO["kv_format"],
        kv_layers=INFO["kv_layers"],
        vllm_version=vllm.__version__,
        block_size=BLOCK,
        chunk_tokens=CHUNK,
        num_layers=2,
        kv_heads="0-2/2",
    )
    return chunk_keys(
        req.block_hashes, hash_block_size=BLOCK, chunk_tokens=CHUNK, fingerprint=ns.fingerprint(),
        max_tokens=req.num_prompt_tokens,
    )  # fmt: skip


def matched(sched: MaruScheduler, req: fakes.Request, computed: int) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` asked again, as vLLM does each step, until the lookup has answered."""
    deadline = time.monotonic() + 30
    while True:
        tokens, is_async = sched.get_num_new_matched_tokens(req, computed)
        if tokens is not None:
            return tokens, is_async
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.001)


def run_prefill(sched: MaruScheduler, req_id: str, table: list[int], steps: list[tuple[int, int]]) -> list:
    """Build one step per (computed before, scheduled) pair; returns each step's metadata."""
    metas = []
    for i, (before, n) in enumerate(steps):
        new, cached = ({req_id: (before, n)}, {}) if i == 0 else ({}, {req_id: (before, n)})
        metas.append(sched.build_connector_meta(fakes.step({req_id: table}, new, cached)))
    return metas
