"""``maru-router``: the decode-direct router in front of a group's prefill and decode engines."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING

from aiohttp import web

from maru_contracts.config import ConfigError, MaruConnectorConfig
from maru_router import limits
from maru_router.revisions import parse_revisions

if TYPE_CHECKING:
    from maru_router.proxy import Router


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="maru-router", description=__doc__)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (OpenAI-compatible API)")
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill engine (repeat); each request goes to the one with the fewest of this router's requests "
        "in flight, round robin among equals",
    )
    p.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="a decode engine (repeat), chosen likewise"
    )
    p.add_argument(
        "--connector-config",
        required=True,
        metavar="JSON",
        help="the connector's kv_connector_extra_config, as the engines get it (pool URL, token file, timeouts)",
    )
    p.add_argument(
        "--min-coverage",
        type=float,
        default=1.0,
        help="share of the prompt's full chunks the pool must hold for decode alone to serve it (0 < x <= 1)",
    )
    p.add_argument(
        "--upstream",
        metavar="URL",
        help="another router (vllm-router) that serves every request not sent to decode alone, and every other "
        "path; --prefill and --decode are then used only to learn the engines' key scheme",
    )
    p.add_argument(
        "--relearn-seconds",
        type=float,
        default=60.0,
        help="with --upstream: how old the learnt key scheme may get before a request goes through prefill here "
        "again to refresh it",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve GET /metrics on this port, and not on the API port (default: on the API port): its counters "
        "name the engines and tell whether anyone sent a prompt",
    )
    p.add_argument(
        "--decode-direct",
        choices=("on", "off"),
        default="on",
        help="off: always prefill then decode (as vllm-router does)",
    )
    p.add_argument(
        "--direct-to-prefill",
        choices=("on", "off"),
        default="off",
        help="off (the default): a prompt the pool covers goes to the least busy decode engine, so prefill "
        "engines stay free for the prompts the pool lacks and decoding never shares a step with a long prefill. "
        "on: it goes to the least busy prefill engine instead when that has fewer of this router's requests in "
        "flight than every decode engine (ties go to decode); the prefill engines must then load from the pool "
        "(kv_role kv_both, as the operator renders them; a kv_producer would compute the whole prompt again)",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="ENGINE_URL=ENDPOINT",
        help="read an engine's KV events (repeat; the ZMQ endpoint its --kv-events-config publishes on), so a "
        "request may go to the engine whose own prefix cache holds more of the prompt than the pool does",
    )
    p.add_argument(
        "--discover-kv-events",
        action="store_true",
        help="ask every --prefill and --decode engine not named by --kv-events where it publishes its KV events "
        "(vLLM's GET /kv_event_sources) and read them",
    )
    p.add_argument(
        "--follow-upstream-workers",
        type=float,
        metavar="SECONDS",
        help="with --upstream: every SECONDS, take the engines the upstream router found (vllm-router's GET "
        "/workers) as --prefill and --decode, pod by pod, and run prefill then decode here when a prefill pod's "
        "own cache holds more of a prompt than the pool (with --discover-kv-events)",
    )
    p.add_argument(
        "--engine-revision",
        action="append",
        default=[],
        metavar="ENGINE_URL=REVISION",
        help="an engine's key revision (repeat), for engines that do not announce it as their KV events' topic "
        "(maru.io/kv-revision=REVISION, read with --discover-kv-events); while the engines span more than one, "
        "prefill then decode runs here with a decode of the prefill's own revision",
    )
    p.add_argument(
        "--locality-slack",
        type=int,
        default=1,
        help="how many more of this router's requests in flight an engine may have than the least busy one of "
        "its role and still be chosen for what its own cache holds beyond the pool (default 1; 0: only among "
        "the least busy)",
    )
    # What one client may make the router hold or compute; the defaults are far above a legitimate request's.
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=limits.MAX_BODY_BYTES,
        help="largest request body taken, in bytes (413 beyond; default %(default)s: 16 MiB)",
    )
    p.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=limits.MAX_BUFFERED_BYTES,
        help="request bodies being read, parsed or keyed at once, all clients together, in bytes (503 beyond: "
        "many large bodies at once would add up past the pod's memory; default %(default)s: 64 MiB)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=limits.MAX_PROMPT_TOKENS,
        help="longest completion prompt given as token ids (400 beyond: the router hashes them itself; "
        "default %(default)s); a longer text prompt is not looked up, and goes through prefill",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=limits.HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection must send a request's headers within this time of opening or of its last answer, and "
        "is closed after this long idle (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=limits.BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="a request's body must be all in within this time of its headers (408 beyond; default %(default)s)",
    )
    return p.parse_args(argv)


def _stop_now(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    # As its container's PID 1, the router gets no signal it has no handler for: a SIGTERM in the seconds of
    # vLLM's import (a pod deleted while it starts: a rollout's surge pod, a scale-down) was lost, and the pod
    # stayed Terminating until SIGKILL at the end of its grace period (600 s by default), its CPU request held.
    signal.signal(signal.SIGTERM, _stop_now)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("maru.router").info("starting: importing vLLM for its block hashing")
    try:
        extra = json.loads(args.connector_config)
        connector = MaruConnectorConfig.from_extra_config(extra if isinstance(extra, dict) else None)
    except (json.JSONDecodeError, ConfigError) as err:
        print(f"maru-router: --connector-config: {err}", file=sys.stderr)
        return 2
    # Imported after the arguments are checked: vLLM's import takes seconds.
    from maru_router.directory import EngineDirectory
    from maru_router.locality import parse_endpoints
    from maru_router.metrics import Metrics
    from maru_router.policy import Routing
    from maru_router.proxy import Router

    try:
        engines = EngineDirectory(
            prefill=args.prefill,
            decode=args.decode,
            metrics=Metrics(),
            kv_events=parse_endpoints(args.kv_events),
            discover_kv_events=args.discover_kv_events,
            locality_slack=args.locality_slack,
            follow_workers_s=args.follow_upstream_workers,
            upstream=args.upstream,
            engine_revisions=parse_revisions(args.engine_revision),
        )
        router = Router(
            engines=engines,
            connector=connector,
            routing=Routing(
                min_coverage=args.min_coverage,
                decode_direct=args.decode_direct == "on",
                direct_to_prefill=args.direct_to_prefill == "on",
            ),
            relearn_s=args.relearn_seconds,
            limits=limits.Limits(
                max_body_bytes=args.max_body_bytes,
                max_prompt_tokens=args.max_prompt_tokens,
                header_timeout_s=args.header_timeout,
                body_timeout_s=args.body_timeout,
                max_buffered_bytes=args.max_buffered_bytes,
            ),
        )
    except ValueError as err:
        print(f"maru-router: {err}", file=sys.stderr)
        return 2
    asyncio.run(serve(router, args.host, args.port, args.metrics_port))
    return 0


async def serve(router: Router, host: str, port: int, metrics_port: int | None) -> None:
    """The API (and the metrics port) until SIGTERM or SIGINT, then a clean stop of both."""
    # aiohttp's keep-alive deadline runs from a connection's start or last answer until a whole request's headers
    # are in: it is the header deadline too (a client trickling headers is closed at it).
    timeouts = {"keepalive_timeout": router.limits.header_timeout_s}
    runners = [web.AppRunner(router.app(metrics=metrics_port is None), **timeouts)]
    if metrics_port is not None:
        runners.append(web.AppRunner(router.metrics_app(), **timeouts))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for runner, at in zip(runners, (port, metrics_port), strict=False):
            await runner.setup()
            await web.TCPSite(runner, host, at).start()
        logging.getLogger("maru.router").info(
            "serving on %s:%d (metrics port %s), upstream %s", host, port, metrics_port, router.upstream
        )
        await stop.wait()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
