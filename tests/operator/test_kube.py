"""The API client: paths, errors, and a rotated service-account token."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Any

import kopf
import pytest
from aiohttp import web

from maru_operator import kube as kube_module
from maru_operator.kube import ApiError, Kube, Unreachable, path


def test_paths() -> None:
    assert path("Deployment", "llm", "x") == "/apis/apps/v1/namespaces/llm/deployments/x"
    assert path("MaruPool", "ignored", "p", "status") == "/apis/maru.io/v1alpha1/marupools/p/status"
    assert path("Service", None) == "/api/v1/services"


async def serve(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_rotated_token_is_picked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async def handler(request: web.Request) -> web.Response:
            if request.headers.get("Authorization") != "Bearer new":
                return web.json_response({"reason": "Unauthorized", "message": "token expired"}, status=401)
            return web.json_response({"kind": "Service", "metadata": {"name": "x"}})

        runner, url = await serve(handler)
        monkeypatch.setattr(kube_module, "login", lambda **_: kopf.ConnectionInfo(server=url, token="new"))
        try:
            async with Kube(kopf.ConnectionInfo(server=url, token="old")) as client:
                old_session = client.session()
                assert (await client.get("Service", "default", "x"))["metadata"]["name"] == "x"  # type: ignore[index]
                gc.collect()  # the old session's closing must not be collected half way
                await asyncio.sleep(0.1)
                assert old_session.closed and client.session() is not old_session
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_errors_carry_status_reason_and_what() -> None:
    async def main() -> None:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response({"reason": "Forbidden", "message": "no"}, status=403)

        runner, url = await serve(handler)
        try:
            async with Kube(kopf.ConnectionInfo(server=url)) as client:
                with pytest.raises(ApiError) as caught:
                    await client.patch("Deployment", "llm", "x", {})
                assert caught.value.status == 403 and "patch Deployment llm/x" in str(caught.value)
        finally:
            await runner.cleanup()
        async with Kube(kopf.ConnectionInfo(server=url), timeout=2) as client:
            with pytest.raises(Unreachable):
                await client.list("Pod", "llm")

    asyncio.run(main())


def test_lists_are_read_in_pages_and_metadata_only_on_request(tmp_path: Any) -> None:
    """Against the emulator: every page is read, the list's resourceVersion is the first page's, and a
    metadata-only list carries no spec."""
    from maru_localcluster.server import running_emulator

    with running_emulator(tmp_path) as cluster:
        for i in range(5):
            cluster.create(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": f"s{i}", "namespace": "default", "labels": {"app": "x"}},
                    "spec": {"ports": [{"port": 80}]},
                }
            )
        mark = cluster.mark()

        async def main() -> None:
            async with Kube(cluster.kopf_connection()) as client:
                items, version = await client.list_with_version("Service", "default", {"app": "x"}, page=2)
                assert [o["metadata"]["name"] for o in items] == [f"s{i}" for i in range(5)]
                assert version is not None and all(o.get("spec") for o in items)
                meta, _ = await client.list_with_version("Service", "default", "app=x", metadata_only=True)
                assert [o["kind"] for o in meta] == ["PartialObjectMetadata"] * 5
                assert all("spec" not in o for o in meta)

        asyncio.run(main())
        lists = [r for r in cluster.requests_since(mark) if r.method == "GET"]
        assert [r.query.get("limit") for r in lists] == ["2", "2", "2", str(kube_module.LIST_PAGE)]
        assert [bool(r.query.get("continue")) for r in lists] == [False, True, True, False]


def test_a_watch_reads_events_of_any_size_however_they_are_chunked() -> None:
    """The operator's informers stream every child through this: events cut anywhere by the network, and objects
    far larger than the client's read buffer, come out whole and in order."""
    big = {"kind": "Deployment", "metadata": {"name": "big", "annotations": {"a": "x" * 300_000}}}
    small = {"kind": "Deployment", "metadata": {"name": "small"}}
    lines = b"".join(
        json.dumps({"type": t, "object": o}).encode() + b"\n"
        for t, o in (("ADDED", small), ("MODIFIED", big), ("DELETED", small))
    )

    async def main() -> None:
        async def handler(request: web.Request) -> web.StreamResponse:
            assert request.query["watch"] == "true" and request.query["resourceVersion"] == "7"
            response = web.StreamResponse()
            await response.prepare(request)
            for at in range(0, len(lines), 7000):  # cuts through lines, as a network does
                await response.write(lines[at : at + 7000])
            await response.write_eof()
            return response

        runner, url = await serve(handler)
        try:
            async with Kube(kopf.ConnectionInfo(server=url)) as client:
                seen = [
                    (t, o["metadata"]["name"], len(json.dumps(o)))
                    async for t, o in client.watch("Deployment", None, "a=b", "7")
                ]
        finally:
            await runner.cleanup()
        assert seen == [
            ("ADDED", "small", len(json.dumps(small))),
            ("MODIFIED", "big", len(json.dumps(big))),
            ("DELETED", "small", len(json.dumps(small))),
        ]

    asyncio.run(main())
