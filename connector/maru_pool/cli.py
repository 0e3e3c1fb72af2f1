"""``maru-pool``: run a pool daemon in one of three roles.

* ``serve``    single node: index and memory in one process (shm, or a device with ``--device``).
* ``metadata`` multi-node: the pool-wide index, allocator, eviction and leases (offsets only, no bytes).
* ``agent``    multi-node, one per node: maps the shared device and hands it to local clients.
* ``token``    print a tenant's token for a pool key (for pools run without the operator).
* ``events``   republish a tenant's pool events over ZMQ in vLLM's KV event format (``publisher.py``).
* ``flush``    drop every chunk a tenant holds in the pool (its event readers see it cleared).

Each role prints one ``maru-pool ready ...`` line on stdout once it accepts connections, and exits 0
on SIGTERM or SIGINT after removing its socket. Bad arguments exit 2 with one line naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from maru_common.cmdline import OneLineParser
from maru_contracts import tenancy

from . import replay
from .client import PoolError
from .daemon import Daemon, UsageError, build_agent, build_metadata, build_serve
from .events import DEFAULT_KEEP, MEDIUM
from .gate import KeyFile, KeyFileError
from .limits import add_flags as add_limit_flags
from .units import parse_size

KEY_FILE_ENV = "MARU_POOL_AUTH_KEY_FILE"

log = logging.getLogger("maru_pool")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="maru-pool", description="Shared KV memory pool daemon for Maru.")
    sub = parser.add_subparsers(dest="role", required=True, parser_class=OneLineParser)

    def common(p: argparse.ArgumentParser, listen_help: str) -> None:
        p.add_argument("--listen", required=True, help=listen_help)
        p.add_argument(
            "--metrics-addr",
            default="0.0.0.0:9400",
            help="host:port for /metrics, /healthz and /status; port 0 picks a free port (default %(default)s)",
        )
        p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
        p.add_argument(
            "--auth-key-file",
            default=os.environ.get(KEY_FILE_ENV) or None,
            help="the pool key (at least 32 bytes): every client must say hello with a token it signed, and "
            f"each tenant gets its own key space (default: ${KEY_FILE_ENV}; none: no authentication)",
        )
        # Connections, frames and time a client may hold (see limits.py).
        add_limit_flags(p)

    def node_name(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--node-name",
            default=os.environ.get("NODE_NAME") or socket.gethostname(),
            help="this node's name in /status (default: $NODE_NAME, else the host name)",
        )

    def index_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--lease-seconds",
            type=_positive,
            default=30.0,
            help="how long a write lease or read pin lives before its space is reclaimed (default %(default)s)",
        )
        p.add_argument(
            "--eviction",
            type=str.lower,
            choices=["lru", "none"],
            default="lru",
            help="when full: evict the least recently used unpinned chunk, or refuse new chunks (default lru)",
        )
        p.add_argument(
            "--events-keep",
            type=_count,
            default=DEFAULT_KEEP,
            help="keys each tenant's event log keeps for its readers; one that falls further behind is resynced "
            "(default %(default)s)",
        )

    serve = sub.add_parser("serve", help="single-node pool: index and memory in one process")
    common(serve, "unix:///path/pool.sock or tcp://host:port")
    serve.add_argument(
        "--size",
        type=_size,
        help="chunk capacity, e.g. 2Gi, as MaruPool.spec.size (required without --device); "
        "an existing shm file is grown to fit, never shrunk under engines that map it",
    )
    serve.add_argument("--device", help="devdax device (or a file standing in for one) instead of shm")
    serve.add_argument("--shm-path", help="shm file to create (default: /dev/shm/maru-pool-<listen address>)")
    index_flags(serve)
    node_name(serve)

    meta = sub.add_parser("metadata", help="multi-node pool: the pool-wide index (no memory)")
    common(meta, "tcp://host:port the agents and clients reach")
    meta.add_argument(
        "--size",
        type=_size,
        help="cap on the bytes used of each device, e.g. 64Gi (default: all of what the first agent reports)",
    )
    meta.add_argument(
        "--agent-stale-seconds",
        type=_positive,
        default=10.0,
        help="an agent silent this long is reported not ready in /status (default %(default)s)",
    )
    index_flags(meta)

    agent = sub.add_parser("agent", help="multi-node pool: per-node owner of the device mapping")
    common(agent, "unix:///path/pool.sock where local clients connect")
    agent.add_argument("--metadata", required=True, help="tcp://host:port of the metadata server")
    agent.add_argument(
        "--device",
        action="append",
        help="devdax device shared by the nodes, e.g. /dev/dax0.0; repeat for several, in the same order on "
        "every node (default: every /dev/dax*.* found)",
    )
    node_name(agent)
    agent.add_argument(
        "--heartbeat-seconds",
        type=_positive,
        default=2.0,
        help="how often to report to the metadata server and adopt its epoch (default %(default)s)",
    )

    token = sub.add_parser("token", help="print the token of a tenant (a key scope) for a pool key")
    token.add_argument("--key-file", required=True, help="the pool key the daemons were given (--auth-key-file)")
    token.add_argument("--tenant", required=True, help="the tenant's key scope, e.g. NAMESPACE/MODEL")
    # The quota travels in the token, signed (see the pool README's Quotas); a field not given is the pool's default.
    token.add_argument("--quota-bytes", type=_size, help="pool memory the tenant may hold, e.g. 16Gi")
    token.add_argument("--quota-pins", type=_count, help="read pins the tenant may hold at once")
    token.add_argument("--quota-leases", type=_count, help="write leases the tenant may hold at once")

    def tenant_link(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--pool",
            required=True,
            help="the serve daemon's socket (unix:///path or tcp://host:port) or a metadata server's "
            "tcp://host:port; not a node agent's",
        )
        p.add_argument("--token-file", help="the tenant's pool credential (none: a pool without a key)")

    events = sub.add_parser("events", help="publish a tenant's pool events over ZMQ in vLLM's KV event format")
    tenant_link(events)
    events.add_argument(
        "--publish",
        default="tcp://*:5557",
        help="ZMQ PUB address to bind, as vLLM's kv-events endpoint (default %(default)s)",
    )
    events.add_argument(
        "--block-size",
        type=_count,
        required=True,
        help="tokens per pool chunk (the group's chunk size): the block_size of the events",
    )
    events.add_argument("--topic", default="", help="ZMQ topic of every message (default: none, as vLLM's)")
    events.add_argument("--medium", default=MEDIUM, help="the events' medium (default %(default)s)")
    events.add_argument(
        "--int-hashes",
        action="store_true",
        help="block hashes as the key's last 8 bytes, a 64-bit integer (as vLLM's "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) instead of the key's bytes",
    )
    events.add_argument(
        "--replay",
        help="ZMQ ROUTER address to bind for replays of missed batches, as vLLM's replay_endpoint (default: none)",
    )
    events.add_argument(
        "--replay-buffer",
        type=_count,
        default=replay.DEFAULT_BUFFER,
        help="batches kept for replays, as vLLM's buffer_steps (default %(default)s)",
    )
    events.add_argument(
        "--replay-max-batches",
        type=_count,
        default=replay.DEFAULT_MAX_BATCHES,
        help="batches in one replay reply; a consumer asks again for the rest (default %(default)s)",
    )
    events.add_argument(
        "--replay-rate",
        type=_count,
        default=replay.DEFAULT_RATE,
        help="replay requests a second per peer address; more are dropped (default %(default)s)",
    )
    events.add_argument(
        "--replay-burst",
        type=_count,
        default=replay.DEFAULT_BURST,
        help="replay requests a peer may send at once (default %(default)s)",
    )
    events.add_argument(
        "--send-hwm",
        type=_count,
        default=1_000,
        help="messages queued per subscriber; past it that subscriber misses them and replays (default %(default)s)",
    )
    events.add_argument(
        "--token-ids",
        action="store_true",
        help="publish each chunk's prompt tokens in BlockStored.token_ids (off: they are the "
        "tenants' prompts; the daemon is not asked for them)",
    )
    events.add_argument(
        "--curve-secret-key-file",
        help="the publisher's ZMQ CURVE secret key (Z85): both sockets admit only the subscribers "
        "--curve-clients-file lists (default: no authentication)",
    )
    events.add_argument(
        "--curve-clients-file",
        help="the admitted subscribers' CURVE public keys (Z85), one a line (a name may follow "
        "the key); read again when it changes",
    )
    events.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    flush = sub.add_parser("flush", help="drop every chunk the tenant holds in the pool")
    tenant_link(flush)
    return parser


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def _print_token(args: argparse.Namespace) -> int:
    try:
        key = KeyFile(args.key_file).current()
    except KeyFileError as err:
        print(f"maru-pool token: error: --key-file {err}", file=sys.stderr)
        return 2
    if not args.tenant:
        print("maru-pool token: error: --tenant: must not be empty", file=sys.stderr)
        return 2
    quota = tenancy.Quota(bytes=args.quota_bytes, pins=args.quota_pins, leases=args.quota_leases)
    print(tenancy.issue(key, tenancy.tenant(args.tenant, quota)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role == "token":
        return _print_token(args)
    if args.role == "flush":
        return _flush(args)
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.role == "events":
        return _publish_events(args)
    builders = {"serve": build_serve, "metadata": build_metadata, "agent": build_agent}
    try:
        daemon: Daemon = builders[args.role](args)
    except UsageError as err:
        print(f"maru-pool {args.role}: error: {err}", file=sys.stderr, flush=True)
        return 2
    return _run(daemon)


def _flush(args: argparse.Namespace) -> int:
    from .link import TenantLink

    try:
        with TenantLink(args.pool, token_file=args.token_file) as link:
            n = int(link.call({"op": "flush"})["chunks"])
    except PoolError as err:
        print(f"maru-pool flush: error: {err}", file=sys.stderr)
        return 1
    print(f"flushed {n} chunk(s)")
    return 0


def _publish_events(args: argparse.Namespace) -> int:
    # Imported here: only this role needs ZMQ and msgspec (the `events` extra), not the daemons.
    from . import publisher

    try:
        role = publisher.build(args)
    except ValueError as err:
        print(f"maru-pool events: error: {err}", file=sys.stderr, flush=True)
        return 2
    stop = _stop_on_signals()
    print("maru-pool ready " + " ".join(f"{k}={v}" for k, v in role.ready.items()), flush=True)
    return publisher.run(role, stop)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def _run(daemon: Daemon) -> int:
    stop = _stop_on_signals()
    try:
        daemon.start()
        fields = daemon.ready_fields()
        print("maru-pool ready " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
        if fields.get("auth") == "off":
            log.warning(
                "no --auth-key-file: clients are not authenticated and share one key space; fine for a pool "
                "run by hand, never for one whose clients do not trust each other"
            )
        while not stop.wait(daemon.tick_seconds):
            daemon.tick()
    finally:
        daemon.close()
    log.info("stopped (pid %d)", os.getpid())
    return 0
