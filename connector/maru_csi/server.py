"""``maru-csi``: the CSI node plugin as a process.

    maru-csi --endpoint unix:///var/lib/kubelet/plugins/csi.maru.io/csi.sock --node-id NODE --socket-root /run/maru

It serves the CSI Identity and Node services on a Unix socket (the kubelet's node-driver-registrar
announces it to the kubelet), prints one ``maru-csi ready ...`` line on stdout once it accepts calls,
and exits 0 on SIGTERM or SIGINT after removing its socket. Bad flags exit 2 with one line naming the
flag. It must run as root (mount(2)) in the host's mount namespace for the target paths, or with the
kubelet's pods directory mounted with Bidirectional propagation, as the chart does.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path

import grpc

from maru_common.cmdline import OneLineParser
from maru_contracts.csi import DEFAULT_SOCKET_ROOT, DRIVER_NAME

from . import csi_pb2_grpc
from .node import IdentityService, NodeService

log = logging.getLogger("maru_csi")

# The kubelet calls one volume at a time per pod; a few threads cover many pods starting at once.
WORKERS = 4
STOP_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="maru-csi", description=f"CSI node plugin {DRIVER_NAME}: the pool socket for pods.")
    parser.add_argument(
        "--endpoint",
        default=os.environ.get("CSI_ENDPOINT", ""),
        help="unix:///path/csi.sock to serve CSI on (default: $CSI_ENDPOINT)",
    )
    parser.add_argument(
        "--node-id",
        default=os.environ.get("NODE_NAME", ""),
        help="this node's name, returned by NodeGetInfo (default: $NODE_NAME)",
    )
    parser.add_argument(
        "--socket-root",
        default=DEFAULT_SOCKET_ROOT,
        help="host directory holding the pools' socket directories; only its direct subdirectories are "
        "published (default %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def endpoint_path(endpoint: str) -> str:
    """The socket path of ``unix:///abs/path``; ValueError for anything else."""
    if not endpoint.startswith("unix://") or not os.path.isabs(endpoint[len("unix://") :]):
        raise ValueError(f"--endpoint {endpoint!r} must be unix:///absolute/path (CSI serves on Unix sockets only)")
    return endpoint[len("unix://") :]


def _clear_stale_socket(path: str) -> None:
    """Remove a socket left by a plugin that died; refuse to take over one that still answers."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"--endpoint {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ValueError(f"--endpoint {path}: another process serves this socket; stop it first")


def serve(endpoint: str, node_id: str, socket_root: Path) -> grpc.Server:
    """Start the plugin's gRPC server; the caller stops it."""
    path = endpoint_path(endpoint)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _clear_stale_socket(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="csi"))
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(socket_root), server)
    csi_pb2_grpc.add_NodeServicer_to_server(NodeService(node_id, socket_root), server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    # Whoever reaches this socket can mount pool directories into any path: the kubelet (root) only.
    os.chmod(path, 0o600)
    return server


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.node_id:
        parser.error("--node-id is required (or set $NODE_NAME)")
    socket_root = Path(os.path.normpath(args.socket_root))
    if not socket_root.is_absolute() or not socket_root.is_dir():
        parser.error(f"--socket-root {args.socket_root} is not an existing absolute directory")
    try:
        server = serve(args.endpoint, args.node_id, socket_root)
    except ValueError as err:
        parser.error(str(err))
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(
        f"maru-csi ready driver={DRIVER_NAME} endpoint={args.endpoint} node={args.node_id} socket_root={socket_root}",
        flush=True,
    )
    stop.wait()
    server.stop(STOP_GRACE_S).wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(endpoint_path(args.endpoint))
    log.info("stopped (pid %d)", os.getpid())
    return 0
