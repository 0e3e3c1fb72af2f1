"""maru-router's prefill-then-decode path speaks vllm-router's P/D protocol (fake engines, no pool).

The same fake vLLM servers as vllm-router's contract test record what the router sends. Until a
prefill has announced a key scheme the router cannot key prompts, so every request takes this path.
"""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.servers import PREFILL_PARAMS, FakeEngine

from .harness import RouterProcess

Routed = tuple[RouterProcess, FakeEngine, FakeEngine]


@pytest.fixture(scope="module")
def router_and_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    workdir = tmp_path_factory.mktemp("contract")
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode")
    # No daemon behind this URL: a router that asked the pool here would fall back, and say so.
    router = RouterProcess("contract", workdir, prefill=prefill.url, decode=decode.url,
                           pool_url=f"unix://{workdir}/no-pool.sock")  # fmt: skip
    try:
        yield router, prefill, decode
    finally:
        router.close()
        prefill.close()
        decode.close()


@pytest.fixture
def routed(router_and_engines: Routed) -> Routed:
    # One router for the module (it imports vLLM at start); each test reads only its own requests.
    for engine in router_and_engines[1:]:
        engine.requests.clear()
    return router_and_engines


def test_prefill_gets_one_token_then_decode_gets_the_prefill_params(
    routed: Routed,
) -> None:
    router, prefill, decode = routed
    body: dict[str, Any] = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "return_token_ids": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip

    before = router.routed("pd", "no_key_scheme")
    events = router.stream(body)

    assert [e["choices"][0]["text"] for e in events] == [" t9"]
    (p,) = prefill.requests
    (d,) = decode.requests
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["prompt"] == d["prompt"] == [5, 6, 7]
    assert d == {**body, "stream": True, "kv_transfer_params": PREFILL_PARAMS}
    assert router.routed("pd", "no_key_scheme") - before == 1


def test_a_chat_asks_prefill_for_one_completion_token(routed: Routed) -> None:
    router, prefill, decode = routed
    body = {"model": "m", "messages": [{"role": "user", "content": "t5 t6"}], "max_completion_tokens": 9}
    router.chat(body)
    (p,) = prefill.requests
    assert p["max_completion_tokens"] == 1 and p["max_tokens"] == 1
    assert decode.requests == [{**body, "kv_transfer_params": PREFILL_PARAMS}]


def test_a_body_that_is_not_an_object_is_refused_by_name(routed: Routed) -> None:
    router, prefill, _ = routed
    req = urllib.request.Request(f"{router.url}/v1/completions", data=b"[1, 2]",
                                 headers={"content-type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert "request body: must be a JSON object" in json.loads(err.value.read())["error"]["message"]
    assert not prefill.requests


# Last: it stops the module's router.
def test_router_stops_on_sigterm(routed: Routed) -> None:
    # PID 1 of its container in a cluster: it must act on SIGTERM, not wait for SIGKILL.
    router, _, _ = routed
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(timeout=60) == 0
