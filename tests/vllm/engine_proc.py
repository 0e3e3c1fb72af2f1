"""One vLLM engine (CPU, in-process core) driven over stdin/stdout by the tests.

Run as ``python -m tests.vllm.engine_proc '<json options>'``. Each request is one JSON line on stdin,
each answer one line on stdout prefixed with ``@@`` (vLLM writes its own lines there too).

Ops: ``generate`` (prompts as token ids, greedy; handoffs in and out), ``flush`` (wait for the
connector's background copies), ``session`` (a streaming-input session: one
request whose prompt grows turn by turn), ``counters`` (connector counters of this process, both
halves), ``metrics`` (the connector's Prometheus counters), ``keys`` (the pool keys of a prompt's
chunks), ``corrupt`` (flip bytes of one stored chunk in the pool memory), ``inject`` / ``clear``
(make a connector or pool-client method fail, to prove the engine survives it), ``handshake`` (vLLM's
start-up connector handshake, again), ``kv_cache_groups`` (the KV cache groups vLLM built),
``reset_prefix_cache`` (vLLM's), ``unretire`` (undo the connector's "off until restart" after a reset,
for the next test), ``exit``.

Option ``async_scheduling``: vLLM's CPU platform turns asynchronous scheduling off (it gains nothing
on a CPU), but it is the default on GPUs, where step N+1 is planned before step N's output is known;
the option turns it back on so that path runs here too. Option ``keep_prefix_caching`` does the same
for prefix caching, which vLLM's CPU platform turns off for MLA models.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def keep_async_scheduling() -> None:
    """Undo vLLM-CPU's override of ``async_scheduling`` (the engine runs the GPU default path)."""
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def keep_prefix_caching() -> None:
    """Undo vLLM-CPU's override of prefix caching for MLA models, so an MLA engine shows its own reuse of a
    prompt's KV (the path a load from the pool takes: the prompt's tail computed over cached context)."""
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        wanted = vllm_config.cache_config.enable_prefix_caching
        original(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = wanted

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def uses_mla(model: str) -> bool:
    """A DeepSeek-style model (multi-head latent attention): its config names a latent rank."""
    config = Path(model) / "config.json"
    return config.is_file() and "kv_lora_rank" in json.loads(config.read_text())


def build(opts: dict[str, Any]):
    from vllm import LLM

    from maru_contracts.config import MaruConnectorConfig, kv_transfer_config

    kwargs: dict[str, Any] = dict(
        model=opts["model"],
        dtype=opts.get("dtype", "float32"),
        max_model_len=16384,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=bool(opts.get("prefix_caching", False)),
        max_num_seqs=8,
        seed=0,
    )
    if uses_mla(opts["model"]) and kwargs["dtype"] == "float32":
        # On a CPU with AMX tiles vLLM picks its AMX MLA backend, which loads bfloat16 weights only ("expect
        # weight to be bfloat16, ...": every MLA engine failed to start on such a machine). Float32 MLA models
        # run vLLM's reference CPU MLA backend on every CPU; bfloat16 ones the backend vLLM picks.
        kwargs["attention_backend"] = "CPU_MLA"
    if opts.get("log_stats"):
        kwargs["disable_log_stats"] = False
    if opts.get("max_loras"):
        kwargs |= {"enable_lora": True, "max_loras": opts["max_loras"], "max_lora_rank": 8}
    if opts.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = opts["max_num_batched_tokens"]
    if opts.get("disable_hybrid_kv_cache_manager"):
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if opts.get("long_prefill_token_threshold"):
        # Caps each prefill's share of a step, so several prefills run side by side.
        kwargs["long_prefill_token_threshold"] = opts["long_prefill_token_threshold"]
    if opts.get("keep_prefix_caching"):
        keep_prefix_caching()
    if opts.get("async_scheduling"):
        keep_async_scheduling()
        kwargs["async_scheduling"] = True
    if opts.get("tp"):
        kwargs["tensor_parallel_size"] = opts["tp"]
        if opts["tp"] > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vllm-cpu binds each rank's threads to a NUMA node of its own unless told which CPUs to use.
            cpus = sorted(os.sched_getaffinity(0))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(opts["tp"]))
    if opts.get("role"):
        cfg = MaruConnectorConfig.from_extra_config(
            {
                "maru_pool_url": opts["pool_url"],
                "maru_kv_chunk_tokens": opts.get("chunk_tokens", 256),
                # Generous: a loaded CI machine must not turn a slow answer into a miss the test counts.
                "maru_rpc_timeout_ms": opts.get("rpc_timeout_ms", 5000),
                **{f"maru_{k}": opts[k] for k in ("load_async", "handoff_wait_ms", "kv_writer_tp") if k in opts},
            }
        )
        ktc = kv_transfer_config(opts["role"], cfg)
        if opts.get("connector_module"):
            ktc["kv_connector"], ktc["kv_connector_module_path"] = opts["connector_module"]
        kwargs["kv_transfer_config"] = ktc
    return LLM(**kwargs)


def generate(llm, req: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation; ``handoffs`` (one ``kv_transfer_params`` per prompt, as a router passes them
    from prefill to decode) go with the requests. Unless ``flush`` is false, waits for the connector's
    background saves to land afterwards, so the next engine asked finds them without a handoff."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    handoffs = req.get("handoffs") or [None] * len(req["prompts"])
    params = [
        SamplingParams(
            max_tokens=req.get("max_tokens", 16),
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": h} if h else None,
        )
        for h in handoffs
    ]
    # One [name, id, path] per prompt (or null: the base model), as vLLM's LoRARequest takes them.
    loras = [LoRARequest(*a) if a else None for a in req.get("loras") or [None] * len(req["prompts"])]
    start = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]],
        params,
        use_tqdm=False,
        lora_request=loras if any(loras) else None,
    )
    elapsed = time.perf_counter() - start
    if req.get("flush", True):
        flush(llm)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "handoffs": [o.kv_transfer_params for o in outs],
        "elapsed_s": elapsed,
    }


def flush(llm) -> None:
    """Wait until the connector's background copies have landed, and give back the blocks finished
    requests held for them.

    ``LLM.generate`` returns once every output is out, and the engine steps only inside the next call;
    a server's engine loop keeps stepping while finished requests hold blocks. Step it here as that
    loop would, so what follows (another engine's lookup, ``reset_prefix_cache``) sees an idle engine.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return
    worker = getattr(get_kv_transfer_group(), "_worker", None)
    core = llm.llm_engine.engine_core.engine_core
    # Saves refused by a sick pool are retried for up to FINISHED_RETRY_S (2 s) before the blocks go back.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if worker is not None:
            worker.wait_idle()
        if core.scheduler.has_unfinished_requests() or not core.scheduler.has_requests():
            return
        core.step_fn()
        time.sleep(0.001)
    raise RuntimeError("finished requests still hold their blocks after 60 s")


def session(llm, req: dict[str, Any]) -> dict[str, Any]:
    """One streaming-input request: each of ``parts`` extends the live request's prompt, as vLLM's
    ``_update_request_as_session`` does for ``AsyncLLM.generate`` with an input stream.

    Driven through the engine core directly (``LLM`` has no streaming-input API); returns the tokens
    generated after each part.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    rid = req.get("request_id", "session")
    turns: list[list[int]] = []
    for part in req["parts"]:
        params = SamplingParams(max_tokens=req.get("max_tokens", 4), temperature=0.0, ignore_eos=True)
        request = engine.input_processor.process_inputs(
            rid, TokensPrompt(prompt_token_ids=part), params, supported_tasks=("generate",), resumable=True
        )
        core.add_request(*core.preprocess_add_request(request))
        tokens: list[int] = []
        for _ in range(10_000):
            outputs, _ = core.step_fn()
            for batch in (outputs or {}).values():
                tokens += [t for out in batch.outputs if out.request_id == rid for t in out.new_token_ids]
            live = core.scheduler.requests.get(rid)
            if live is None or live.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                break
        turns.append(tokens)
    core.abort_requests([rid])
    return {"turns": turns}


_injected: list[tuple[object, str, object]] = []


def inject(req: dict[str, Any]) -> dict[str, Any]:
    """Make a method fail: ``target`` is ``module:Class.method`` (the first of a list that exists),
    ``error`` the exception class name (a pool error, or RuntimeError), ``times`` how many calls fail
    (None: every call until ``clear``), ``lose_from`` for ``open_read_many`` only: pins from this
    index on come back as misses (a chunk evicted between lookup and load), ``delay_s``: the call is
    made that much later instead of failing."""
    import importlib

    import maru_pool as pool

    for target in req["target"] if isinstance(req["target"], list) else [req["target"]]:
        module_name, _, attr = target.partition(":")
        owner_name, _, method = attr.rpartition(".")
        owner = importlib.import_module(module_name)
        for part in owner_name.split("."):
            owner = getattr(owner, part)
        if hasattr(owner, method):
            break
    else:
        return {"error": f"none of {req['target']} exists"}
    original = getattr(owner, method)
    left = [req.get("times")]
    error = getattr(pool, req.get("error", ""), RuntimeError)
    lose_from = req.get("lose_from")
    delay_s = req.get("delay_s")

    def failing(*args: Any, **kwargs: Any) -> Any:
        if left[0] is not None and left[0] <= 0:
            return original(*args, **kwargs)
        if left[0] is not None:
            left[0] -= 1
        if delay_s is not None:
            time.sleep(delay_s)  # a slow pool: the call succeeds, late
            return original(*args, **kwargs)
        if lose_from is None:
            raise error(f"fault injected into {target}")
        pins = original(*args, **kwargs)
        lost = [p for p in pins[lose_from:] if p is not None]
        if lost:
            args[0].release_many(lost)
        return pins[:lose_from] + [None] * len(pins[lose_from:])

    _injected.append((owner, method, original))
    setattr(owner, method, failing)
    return {"ok": True, "target": target}


def clear() -> dict[str, Any]:
    while _injected:
        owner, method, original = _injected.pop()
        setattr(owner, method, original)
    return {"ok": True}


def handshake(llm) -> dict[str, Any]:
    """vLLM's connector handshake again, as ``EngineCore.__init__`` runs it once at start (0.32): every
    worker's ``get_handshake_metadata``, merged, into the scheduler's ``set_xfer_handshake_metadata``."""
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.get_kv_connector()
    per_worker = core.model_executor.get_kv_connector_handshake_metadata()
    content: dict = {}
    if per_worker:
        for worker_dict in per_worker:
            if worker_dict is not None:
                content.update(worker_dict)
        connector.set_xfer_handshake_metadata_pp_aware(content)
    namespace = getattr(connector._scheduler, "namespace", None)
    return {
        "ok": True,
        "ranks": sorted(tp for _, tp in content),
        "active": connector._scheduler.active,
        "kv_format": getattr(namespace, "kv_format", None),
        "key_heads": getattr(namespace, "kv_heads", None),
        "kv_cache_groups": len(core.scheduler.kv_cache_config.kv_cache_groups),
    }


def kv_cache_groups(llm) -> dict[str, Any]:
    """The KV cache groups vLLM built: per group, its spec's class, sliding window (or None) and layer count."""
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    return {
        "groups": [
            [type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None), len(g.layer_names)]
            for g in groups
        ]
    }


def unretire(llm) -> dict[str, Any]:
    """Test seam: undo ``reset_cache``'s "off until restart", so the module's engine serves the next test."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    sched.disabled_reason = None
    return {"ok": True, "active": sched.active}


def keys(llm, req: dict[str, Any]) -> dict[str, Any]:
    n = len(req["prompt"]) // llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.chunk_tokens
    return {"keys": [chunk_key(llm, req["prompt"], i).hex() for i in range(n)]}


def chunk_key(llm, prompt: list[int], chunk: int) -> bytes:
    """The key the connector stores chunk ``chunk`` of ``prompt`` under, from vLLM's block hash chain."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from maru_contracts.keys import chunk_keys

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler.connector._scheduler
    hash_fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    bs = sched.hash_block_size
    parent, hashes = None, []
    for b in range(len(prompt) // bs):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, prompt[b * bs : (b + 1) * bs])
        hashes.append(parent)
    keys = chunk_keys(hashes, hash_block_size=bs, chunk_tokens=sched.chunk_tokens, fingerprint=sched.fingerprints[0])
    return keys[chunk]


def corrupt(llm, req: dict[str, Any]) -> dict[str, Any]:
    """Flip bytes in the middle of one stored chunk, behind the pool's back (as a bad DIMM would)."""
    from maru_pool import PoolClient
    from maru_pool.memory import HEADER_SIZE

    key = chunk_key(llm, req["prompt"], req["chunk"])
    client = PoolClient(req["pool_url"], timeout_s=5)
    try:
        reply = client._call({"op": "read", "keys": [key.hex()]})
        pin = reply["pins"][0]
        if pin is None:
            return {"error": "chunk not in the pool"}
        pin_id, offset, nbytes, _ = pin
        client._call({"op": "release", "epoch": reply["epoch"], "pins": [pin_id]})
    finally:
        client.close()
    with open(req["shm_path"], "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = HEADER_SIZE + offset + nbytes // 2
        mm[at : at + 16] = bytes(b ^ 0xFF for b in mm[at : at + 16])
    return {"ok": True, "key": key.hex()}


def metrics(llm) -> dict[str, float]:
    """The connector's Prometheus counters as vLLM exports them (needs ``log_stats``)."""
    from prometheus_client import REGISTRY

    llm.llm_engine.do_log_stats()
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("vllm:maru_connector_") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def exit_now(llm) -> NoReturn:
    """vLLM's own shutdown (the executor and scheduler, and with them the connector), then the process ends
    without the interpreter's finalization of torch and vLLM: that took 5-8 s of CPU per engine, for nothing."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # an engine core that died in a test: nothing left to shut down
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    opts = json.loads(sys.argv[1])
    try:
        llm = build(opts)
    except Exception:
        # A refused start (what some tests expect): the reason, and an end without the interpreter's finalization.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    from maru_connector.vllm import counters

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "exit":
                answer({"ok": True})
                exit_now(llm)
            if op == "generate":
                answer(generate(llm, req))
            elif op == "counters":
                answer({"counters": counters()})
            elif op == "flush":
                flush(llm)
                answer({"ok": True})
            elif op == "metrics":
                answer({"metrics": metrics(llm)})
            elif op == "corrupt":
                answer(corrupt(llm, req))
            elif op == "session":
                answer(session(llm, req))
            elif op == "inject":
                answer(inject(req))
            elif op == "clear":
                answer(clear())
            elif op == "keys":
                answer(keys(llm, req))
            elif op == "handshake":
                answer(handshake(llm))
            elif op == "kv_cache_groups":
                answer(kv_cache_groups(llm))
            elif op == "unretire":
                answer(unretire(llm))
            elif op == "reset_prefix_cache":
                # vLLM's own API: drop the local prefix cache (and, if asked, the connector's).
                answer({"ok": llm.reset_prefix_cache(reset_connector=bool(req.get("reset_connector", False)))})
            else:
                answer({"error": f"unknown op {op}"})
        except Exception as err:  # report to the test, which decides whether dying was expected
            answer({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
