"""Assembly of the three daemon roles from parsed flags: memory, index, RPC and HTTP servers.

Builders turn every bad flag into a :class:`UsageError` naming it, before anything is listening.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import logging
import os
import re
from collections.abc import Callable
from typing import Any

from maru_contracts import tenancy

from .agent import NodeAgent
from .gate import AuthGate, KeyFile, KeyFileError
from .httpd import HttpEndpoint
from .index import PoolIndex
from .limits import Limits
from .limits import from_args as limits_from_args
from .memory import PoolMemory, PoolMemoryError, discover_devices, new_epoch_floor
from .rpc import ListenError, Peer, RpcServer
from .service import AgentRegistry, IndexService, LocalMemoryHello, Reply, fail
from .units import Endpoint, parse_endpoint

log = logging.getLogger(__name__)


class UsageError(Exception):
    """A flag's value cannot be used; the message starts with the flag."""


class Daemon:
    """A started role: RPC and HTTP servers plus a periodic ``tick`` run by the main thread."""

    def __init__(
        self,
        rpc: RpcServer,
        http: HttpEndpoint,
        *,
        ready: Callable[[], dict[str, Any]],
        tick: Callable[[], object],
        tick_seconds: float,
        cleanup: Callable[[], None] = lambda: None,
    ) -> None:
        self.rpc = rpc
        self.http = http
        self._ready = ready
        self._tick = tick
        self.tick_seconds = tick_seconds
        self._cleanup = cleanup

    def start(self) -> None:
        self.rpc.start()
        self.http.start()

    def ready_fields(self) -> dict[str, Any]:
        return {**self._ready(), "metrics": self.http.address}

    def tick(self) -> None:
        try:
            self._tick()
        except Exception:  # housekeeping must never take the daemon down
            log.exception("periodic housekeeping failed; retrying on the next tick")

    def close(self) -> None:
        for closer in (self.rpc.close, self.http.close, self._cleanup):
            try:
                closer()
            except Exception:
                log.exception("shutdown step failed; continuing")


def _key_file(args: argparse.Namespace) -> KeyFile | None:
    """The pool key that authenticates clients, or None when the daemon runs without one."""
    path = getattr(args, "auth_key_file", None)
    if not path:
        return None  # the ready line says auth=off, and the CLI warns
    try:
        return KeyFile(path)
    except KeyFileError as err:
        raise UsageError(f"--auth-key-file {err}") from None


class _Late:
    """Callbacks wired after the sockets are bound: a daemon claims its socket and metrics port
    before it touches any memory, so a second daemon started by mistake changes nothing."""

    def __init__(self) -> None:
        self.handle: Callable[[dict[str, Any], Peer], Reply] = lambda _m, _p: fail("unavailable", "starting")
        self.closed: Callable[[Peer], None] = lambda _p: None
        self.stats: Callable[[], dict[str, Any]] = dict
        self.status: Callable[[], dict[str, Any]] = dict
        self.healthy: Callable[[], bool] = lambda: True
        # Starting: no connection is verified, so the before-hello bounds hold until the gate is wired.
        self.verified: Callable[[Peer], bool] = lambda _p: False

    def bind(self, endpoint: Endpoint, metrics_addr: str, limits: Limits, role: str) -> tuple[RpcServer, HttpEndpoint]:
        rpc = _rpc(
            endpoint,
            lambda msg, peer: self.handle(msg, peer),
            on_close=lambda peer: self.closed(peer),
            verified=lambda peer: self.verified(peer),
            limits=limits,
            role=role,
        )
        http = _http(
            metrics_addr,
            lambda: {**self.stats(), **rpc.stats()},
            lambda: self.status(),
            healthy=lambda: self.healthy(),
            on_fail=rpc.close,
        )
        return rpc, http


def build_serve(args: argparse.Namespace) -> Daemon:
    endpoint = _listen(args.listen)
    keys = _key_file(args)
    if args.device:
        _must_exist("--device", args.device)
    elif args.size is None:
        raise UsageError("--size: required for the shm backend (e.g. --size 2Gi), or give --device")
    else:
        path = args.shm_path or _default_shm_path(endpoint)
        if not os.path.isdir(os.path.dirname(path) or "."):
            raise UsageError(f"--shm-path {path}: directory {os.path.dirname(path)} does not exist")
    late = _Late()
    rpc, http = late.bind(endpoint, args.metrics_addr, _limits(args), "serve")
    try:
        memory, owned_file = _open_serve_memory(args, endpoint)
    except UsageError:
        rpc.close()
        http.close()
        raise
    epoch = memory.bump_epoch()
    index = PoolIndex(
        memory.capacity,
        epoch=epoch,
        lease_seconds=args.lease_seconds,
        evict=args.eviction == "lru",
        events_keep=args.events_keep,
        tenant_ceiling=_limits(args).tenant_ceiling,
    )

    def status() -> dict[str, Any]:
        stats = index.stats()
        return {
            "role": "serve",
            "backend": memory.backend,
            "capacity_bytes": stats["capacity_bytes"],
            "used_bytes": stats["used_bytes"],
            "chunks": stats["chunks"],
            "epoch": epoch,
            "nodes": [{"node": args.node_name, "device": memory.path, "ready": True}],
            "stats": stats,
            "tenants": service.tenant_stats(),
        }

    service = IndexService(index, hello=LocalMemoryHello(memory, epoch, index.capacity), status=status)
    gate = AuthGate(service.handle, keys, role="serve")
    late.handle, late.status = gate.handle, status
    late.verified = gate.verified
    late.closed = _both(gate.closed, service.closed)
    # /metrics also carries each tenant's use against its quota (labelled families; see httpd.py).
    late.stats = lambda: {**index.stats(), "auth_refusals": gate.refusals, "tenants": service.tenant_stats()}

    def cleanup() -> None:
        memory.close()
        if owned_file:
            # The shm file is RAM; a stopped pool gives it back. The next start bumps the epoch anyway.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(owned_file)

    return Daemon(
        rpc,
        http,
        ready=lambda: {
            "role": "serve",
            "listen": rpc.endpoint.url,
            "backend": memory.backend,
            "capacity": index.capacity,
            "epoch": epoch,
            "auth": _on_off(gate),
        },
        # Clients map the header read-write: nothing trusts it, but a restart reads it, so keep it ours.
        tick=lambda: (index.expire(), memory.keep_header(epoch)),
        tick_seconds=_sweep_interval(args.lease_seconds),
        cleanup=cleanup,
    )


def _open_serve_memory(args: argparse.Namespace, endpoint: Endpoint) -> tuple[PoolMemory, str | None]:
    """The memory of a ``serve`` daemon, locked so no second daemon can index the same bytes."""
    if args.device:
        flag, path = "--device", args.device
        try:
            memory = PoolMemory.open_device(path, args.size)
        except (PoolMemoryError, OSError) as err:
            raise UsageError(f"--device {path}: {err}") from None
    else:
        flag, path = "--shm-path", args.shm_path or _default_shm_path(endpoint)
        try:
            memory = PoolMemory.open_shm(path, args.size, before_resize=_lock_or_refuse(flag))
        except PoolMemoryError as err:
            raise UsageError(f"--size {args.size}: {err}") from None
        except OSError as err:
            raise UsageError(f"--shm-path {path}: cannot create the pool memory: {err.strerror}") from None
        return memory, path
    try:
        _lock_or_refuse(flag)(memory.fd, path)
    except UsageError:
        memory.close()
        raise
    return memory, None


def _lock_or_refuse(flag: str) -> Callable[[int, str], None]:
    def lock(fd: int, path: str) -> None:
        # A POSIX record lock belongs to this process alone. flock() would not do: it belongs to the
        # open file, which clients share through the passed fd (Python's mmap keeps a dup of it), so
        # a restarted daemon would find it still held by its old clients.
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                log.warning(
                    "%s %s: cannot be locked (%s); make sure no other pool daemon uses it", flag, path, err.strerror
                )
                return
            raise UsageError(f"{flag} {path}: in use by another pool daemon; stop it or use other memory") from None

    return lock


def build_metadata(args: argparse.Namespace) -> Daemon:
    endpoint = _listen(args.listen)
    keys = _key_file(args)
    limits = _limits(args)
    # No memory to keep an epoch in: the clock makes each start's epoch larger than the last one's.
    epoch = new_epoch_floor()
    agents = AgentRegistry(stale_after_s=args.agent_stale_seconds)

    def make_index(usable: list[int]) -> PoolIndex:
        # --size caps each device; without it the pool uses all of what the first agent reports.
        capacities = [min(u, args.size) if args.size else u for u in usable]
        return PoolIndex(
            capacities,
            epoch=epoch,
            lease_seconds=args.lease_seconds,
            evict=args.eviction == "lru",
            events_keep=args.events_keep,
            tenant_ceiling=limits.tenant_ceiling,
        )

    service: IndexService
    gate: AuthGate

    def stats() -> dict[str, int]:
        ready = sum(a["ready"] for a in agents.snapshot())
        if service.index is None:
            return {"capacity_bytes": 0, "used_bytes": 0, "chunks": 0, "epoch": epoch,
                    "errors": service.errors_before_index, "agents_ready": ready,
                    "auth_refusals": gate.refusals, **rpc.stats()}  # fmt: skip
        return {**service.index.stats(), "agents_ready": ready, "auth_refusals": gate.refusals, **rpc.stats()}

    def status() -> dict[str, Any]:
        s = stats()
        known = agents.snapshot()
        return {
            "role": "metadata",
            "backend": "dax",
            "capacity_bytes": s["capacity_bytes"],
            "used_bytes": s["used_bytes"],
            "chunks": s["chunks"],
            "epoch": epoch,
            "regions": service.index.capacities if service.index else [],
            "agents": known,
            "nodes": [{"node": a["node"], "ready": a["ready"]} for a in known],
            "stats": s,
            "tenants": service.tenant_stats(),
        }

    def hello(_is_unix: bool) -> Reply:
        return fail("unavailable", "this is the metadata server; clients connect to their node agent's socket")

    service = IndexService(None, hello=hello, status=status, agents=agents, make_index=make_index)
    gate = AuthGate(service.handle, keys, role="metadata")
    rpc = _rpc(
        endpoint,
        gate.handle,
        on_close=_both(gate.closed, service.closed),
        verified=gate.verified,
        limits=limits,
        role="metadata",
    )
    http = _http(
        args.metrics_addr,
        lambda: {**stats(), "tenants": service.tenant_stats()},
        status,
        on_fail=rpc.close,
    )

    def expire() -> None:
        if service.index is not None:
            service.index.expire()

    return Daemon(
        rpc,
        http,
        ready=lambda: {
            "role": "metadata",
            "listen": rpc.endpoint.url,
            "size_cap": args.size or "none",
            "epoch": epoch,
            "auth": _on_off(gate),
        },
        tick=expire,
        tick_seconds=_sweep_interval(args.lease_seconds),
    )


def build_agent(args: argparse.Namespace) -> Daemon:
    endpoint = _listen(args.listen)
    if endpoint.kind != "unix":
        raise UsageError(f"--listen {args.listen}: an agent passes the device by fd and needs a unix:// socket")
    try:
        metadata = parse_endpoint(args.metadata)
    except ValueError as err:
        raise UsageError(f"--metadata: {err}") from None
    if metadata.kind != "tcp" or metadata.port == 0:
        raise UsageError(f"--metadata {args.metadata}: expected tcp://host:port of the metadata server")
    devices = args.device or discover_devices()
    if not devices:
        raise UsageError("--device: none given and no devdax device (/dev/dax*.*) found on this node")
    if len(set(devices)) != len(devices):
        raise UsageError(f"--device: listed twice: {sorted(d for d in devices if devices.count(d) > 1)[0]}")
    for device in devices:
        _must_exist("--device", device)
    keys = _key_file(args)
    late = _Late()
    rpc, http = late.bind(endpoint, args.metrics_addr, _limits(args), "agent")
    memories: list[PoolMemory] = []
    try:
        for device in devices:
            try:
                memories.append(PoolMemory.open_device(device, None))
            except (PoolMemoryError, OSError) as err:
                raise UsageError(f"--device {device}: {err}") from None
    except UsageError:
        for memory in memories:
            memory.close()
        rpc.close()
        http.close()
        raise
    credential = (lambda: tenancy.issue(keys.current(), tenancy.agent(args.node_name))) if keys else (lambda: None)
    agent = NodeAgent(memories, metadata, args.node_name, credential=credential)
    gate = AuthGate(agent.handle, keys, role="agent")
    late.handle, late.status, late.healthy = gate.handle, agent.status, agent.healthy
    late.verified = gate.verified
    late.closed = gate.closed
    late.stats = lambda: {**agent.stats(), "auth_refusals": gate.refusals}
    # First contact before serving, so clients are not refused needlessly; a metadata server that
    # is not up yet is retried on every heartbeat.
    agent.heartbeat()

    def cleanup() -> None:
        agent.close()
        for memory in memories:
            memory.close()

    return Daemon(
        rpc,
        http,
        ready=lambda: {
            "role": "agent",
            "listen": rpc.endpoint.url,
            "metadata": metadata.url,
            "backend": "dax",
            "devices": ",".join(m.path for m in memories),
            "node": args.node_name,
            "connected": str(agent.connected).lower(),
            "auth": _on_off(gate),
        },
        tick=agent.heartbeat,
        tick_seconds=args.heartbeat_seconds,
        cleanup=cleanup,
    )


def _both(*closers: Callable[[Peer], None]) -> Callable[[Peer], None]:
    def closed(peer: Peer) -> None:
        for close in closers:
            close(peer)

    return closed


def _on_off(gate: AuthGate) -> str:
    return "on" if gate.enabled else "off"


def _listen(url: str) -> Endpoint:
    try:
        endpoint = parse_endpoint(url)
    except ValueError as err:
        raise UsageError(f"--listen: {err}") from None
    if endpoint.kind == "unix":
        directory = os.path.dirname(endpoint.path)
        if not os.path.isdir(directory):
            raise UsageError(f"--listen {url}: socket directory {directory} does not exist; create it or mount it")
    return endpoint


def _must_exist(flag: str, path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: not found")


def _limits(args: argparse.Namespace) -> Limits:
    """The connection and frame limits the flags name (see limits.py), checked before anything listens."""
    try:
        return limits_from_args(args)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _rpc(
    endpoint: Endpoint,
    handler: Any,
    on_fail: Callable[[], object] = lambda: None,
    on_close: Callable[[Peer], None] = lambda _peer: None,
    *,
    verified: Callable[[Peer], bool],
    limits: Limits,
    role: str,
) -> RpcServer:
    try:
        return RpcServer(endpoint, handler, on_close=on_close, verified=verified, limits=limits, role=role)
    except ListenError as err:
        on_fail()
        raise UsageError(str(err)) from None


def _http(
    address: str,
    stats: Callable[[], dict[str, Any]],
    status: Callable[[], dict[str, Any]],
    *,
    healthy: Callable[[], bool] = lambda: True,
    on_fail: Callable[[], object] = lambda: None,
) -> HttpEndpoint:
    try:
        return HttpEndpoint(address, stats=stats, status=status, healthy=healthy)
    except ValueError as err:
        on_fail()
        raise UsageError(str(err)) from None
    except OSError as err:
        on_fail()
        raise UsageError(f"--metrics-addr {address}: cannot bind: {err.strerror}") from None


def _default_shm_path(endpoint: Endpoint) -> str:
    name = endpoint.path if endpoint.kind == "unix" else f"{endpoint.host}-{endpoint.port}"
    return "/dev/shm/maru-pool-" + re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def _sweep_interval(lease_seconds: float) -> float:
    # Expired leases are reclaimed within a quarter of their lifetime, and at most every second.
    return min(1.0, lease_seconds / 4)
