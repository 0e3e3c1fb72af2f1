"""``maru-router``: the decode-direct router in front of a group's prefill and decode engines."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from aiohttp import web

from maru_connector.config import ConfigError, MaruConnectorConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="maru-router", description=__doc__)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (OpenAI-compatible API)")
    p.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill engine (repeat)")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode engine (repeat)")
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
        "--decode-direct",
        choices=("on", "off"),
        default="on",
        help="off: always prefill then decode (as vllm-router does)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        extra = json.loads(args.connector_config)
        connector = MaruConnectorConfig.from_extra_config(extra if isinstance(extra, dict) else None)
    except (json.JSONDecodeError, ConfigError) as err:
        print(f"maru-router: --connector-config: {err}", file=sys.stderr)
        return 2
    # Imported after the arguments are checked: vLLM's import takes seconds.
    from maru_connector.router.proxy import Router

    try:
        router = Router(
            prefill=args.prefill,
            decode=args.decode,
            connector=connector,
            min_coverage=args.min_coverage,
            decode_direct=args.decode_direct == "on",
        )
    except ValueError as err:
        print(f"maru-router: {err}", file=sys.stderr)
        return 2
    web.run_app(router.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
