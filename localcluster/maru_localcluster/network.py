"""The local cluster's network: a network namespace for the cluster, and one for every pod.

A real pod has a network namespace of its own: it binds ``0.0.0.0:9400`` without asking whether the
machine, or another pod, already listens there. Here too:

* **The cluster network** is a network namespace of its own, held by a ``sleep`` that dies with the
  process that started the cluster. It holds a bridge (``cni0``) that every pod's veth is attached to,
  the node addresses (the bridge's gateway address of each node's pod range), the Service range and
  the API server's address on its loopback. The kubelets and kube-proxy run inside it, as node
  components run in a node's host network.
* **Every pod** gets a network namespace (held by the pod's sandbox process, as the pause container
  holds it in a cluster), an ``eth0`` with its address from its node's range, a default route to its
  node's gateway, and ``lo``. Its containers join it.
* **The machine's network is never touched**: no interface, route or address is added to it, and the
  cluster network has no link to it, so nothing sent inside can leave the machine, whatever the
  address. Every cluster uses the same addresses (the usual kind/kubeadm ranges) without collisions.
  Processes outside (tests, the demo, ``kubectl``) reach the API server on the machine's loopback,
  and Services and pods through :class:`Doors`: ``127.0.0.1:<free port>`` forwarding into the
  cluster network, what ``kubectl port-forward`` is to a real cluster.

Everything lives as long as a process is in it: when the cluster's processes end, however they end,
the kernel removes the namespaces with their interfaces and addresses.

Layout::

    10.244.0.1          the API server inside the cluster network (HTTP 8080 for node components,
                        TLS 6443 behind the ``kubernetes`` Service)
    10.244.<n>.1/24     node n's address, the gateway of its pods (10.244.<n>.2 ... .254)
    10.96.0.0/16        Service ClusterIPs (10.96.0.1 is the ``kubernetes`` Service)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import itertools
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000

CONTROL_PLANE_ADDRESS = "10.244.0.1"
API_HTTP_PORT = 8080
API_TLS_PORT = 6443
SERVICE_NETWORK = ipaddress.IPv4Network("10.96.0.0/16")
KUBERNETES_SERVICE_IP = "10.96.0.1"
BRIDGE = "cni0"
MAX_NODES = 250

_libc = ctypes.CDLL(None, use_errno=True)


class NetworkSetupError(RuntimeError):
    """A namespace, interface or address could not be set up; the message names the step."""


def ip_command() -> str | None:
    """The ``ip`` program (iproute2), or None when this machine lacks it."""
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.path.exists(p)), None
    )


def node_address(index: int) -> str:
    """Node ``index``'s own address (1-based): its pods' gateway."""
    return str(pod_network(index)[1])


def pod_network(index: int) -> ipaddress.IPv4Network:
    if not 1 <= index <= MAX_NODES:
        raise NetworkSetupError(f"node index {index} outside 1..{MAX_NODES}")
    return ipaddress.IPv4Network(f"10.244.{index}.0/24")


def service_addresses() -> Iterator[str]:
    """ClusterIPs in allocation order, after the ``kubernetes`` Service's."""
    for host in itertools.islice(SERVICE_NETWORK.hosts(), 1, None):
        yield str(host)


class PodAddresses:
    """Pod IPs of one node: .2 to .254 of its /24, handed out round-robin, never two live at once."""

    def __init__(self, network: ipaddress.IPv4Network) -> None:
        self.network = network
        self._hosts = [str(h) for h in network.hosts()][1:]  # .1 is the node's own address
        self._next = 0
        self._used: set[str] = set()

    def take(self) -> str:
        for _ in range(len(self._hosts)):
            ip = self._hosts[self._next]
            self._next = (self._next + 1) % len(self._hosts)
            if ip not in self._used:
                self._used.add(ip)
                return ip
        raise NetworkSetupError(f"no pod address left in {self.network}")

    def keep(self, ip: str) -> None:
        """Mark an address as in use (pods found running when the kubelet starts)."""
        self._used.add(ip)

    def give_back(self, ip: str) -> None:
        self._used.discard(ip)


# ------------------------------------------------------------------------------------------ namespaces


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetworkSetupError(f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """This thread (only) in the network namespace at path ``netns`` until the block ends.

    A socket belongs to the namespace it was created in for its whole life, so a socket made here
    listens or connects inside ``netns`` after the thread has left it.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(netns, os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def socket_in(netns: str, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM) -> socket.socket:
    with entered(netns):
        return socket.socket(family, kind)


def listener_in(netns: str, host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` inside ``netns``."""
    sock = socket_in(netns)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        raise NetworkSetupError(f"listening on {host}:{port} in the cluster network: {err}") from err
    return sock


def enter_in_child(netns: str) -> None:
    """For ``preexec_fn``: the child process starts inside ``netns``."""
    fd = os.open(netns, os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


def sandbox_argv(python: str = sys.executable) -> list[str]:
    """``podrun pause``: a process that holds a new network namespace until it is killed or its parent ends."""
    return [python, "-m", "maru_localcluster.podrun", "pause"]


def sandbox_env() -> dict[str, str]:
    return {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": os.environ.get("PATH", "")}


def netns_path(pid: int) -> str:
    return f"/proc/{pid}/ns/net"


def has_own_netns(pid: int) -> bool:
    """Whether process ``pid`` has left its parent's network namespace (a new sandbox is ready)."""
    try:
        return os.readlink(netns_path(pid)) != os.readlink("/proc/thread-self/ns/net")
    except OSError:
        return False


def ip_batch(commands: list[str], netns: str | None = None) -> list[str]:
    """The argv that runs ``ip -batch -`` (commands on stdin), inside ``netns`` when given."""
    ip = ip_command()
    if ip is None:
        raise NetworkSetupError("the 'ip' program (iproute2) is missing: apt-get install iproute2")
    argv = [ip, "-batch", "-"]
    if netns is not None:
        nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
        argv = [nsenter, f"--net={netns}", *argv]
    return argv


def run_ip(commands: list[str], netns: str | None = None) -> None:
    result = subprocess.run(
        ip_batch(commands, netns), input="\n".join(commands) + "\n", capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise NetworkSetupError(f"ip {commands}: {result.stderr.strip() or result.stdout.strip()}")


async def run_ip_async(commands: list[str], netns: str | None = None) -> None:
    proc = await asyncio.create_subprocess_exec(
        *ip_batch(commands, netns), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out, _ = await proc.communicate(("\n".join(commands) + "\n").encode())
    if proc.returncode != 0:
        raise NetworkSetupError(f"ip {commands}: {out.decode(errors='replace').strip()}")


def set_sysctl(netns: str, key: str, value: str) -> None:
    """A per-namespace sysctl (``net.ipv4.ip_forward``), written from inside ``netns``."""
    path = "/proc/sys/" + key.replace(".", "/")
    # A child inside the namespace writes it: /proc/sys/net shows the namespace of whoever opens it.
    subprocess.run(
        ["/bin/sh", "-c", f"echo {value} > {path}"],
        preexec_fn=lambda: enter_in_child(netns),
        check=True,
        timeout=30,
        capture_output=True,
    )


# ------------------------------------------------------------------------------------------ cluster


class ClusterNetwork:
    """The network namespace of one local cluster: bridge, node gateways, Service range, API address."""

    def __init__(self) -> None:
        self._holder: subprocess.Popen[bytes] | None = None
        self.path = ""

    def start(self) -> ClusterNetwork:
        if ip_command() is None:
            raise NetworkSetupError("the 'ip' program (iproute2) is missing: apt-get install iproute2")
        self._holder = subprocess.Popen(
            sandbox_argv(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=sandbox_env(),
        )
        self.path = netns_path(self._holder.pid)
        deadline = time.monotonic() + 30
        while not has_own_netns(self._holder.pid):
            if self._holder.poll() is not None or time.monotonic() > deadline:
                exited = self._holder.poll() is not None and self._holder.stderr is not None
                why = self._holder.stderr.read().decode(errors="replace").strip() if exited else "timed out"
                self.stop()
                raise NetworkSetupError(f"the cluster network could not be created: {why}")
            time.sleep(0.005)
        run_ip(
            [
                "link set lo up",
                f"addr add {CONTROL_PLANE_ADDRESS}/32 dev lo",
                f"addr add {SERVICE_NETWORK} dev lo",
                f"link add {BRIDGE} type bridge",
                f"link set {BRIDGE} up",
            ],
            self.path,
        )
        set_sysctl(self.path, "net.ipv4.ip_forward", "1")  # pods of different nodes reach each other
        return self

    def add_node(self, index: int) -> None:
        network = pod_network(index)
        run_ip([f"addr add {node_address(index)}/{network.prefixlen} dev {BRIDGE}"], self.path)

    @property
    def alive(self) -> bool:
        return self._holder is not None and self._holder.poll() is None

    def stop(self) -> None:
        if self._holder is not None and self._holder.poll() is None:
            self._holder.kill()
            self._holder.wait()
        self._holder = None


# ------------------------------------------------------------------------------------------ pods


def veth_name(pod_uid: str) -> str:
    """The cluster-side end of a pod's veth: unique per pod, at most 15 characters."""
    return "veth" + pod_uid.replace("-", "")[:11]


async def attach_pod(sandbox_pid: int, pod_uid: str, ip: str, prefix_len: int, gateway: str) -> None:
    """Give the pod's namespace (held by ``sandbox_pid``) ``lo``, an ``eth0`` on the bridge and a route out.

    Runs inside the cluster network (the kubelet does): the veth's first end stays there.
    """
    outside = veth_name(pod_uid)
    await run_ip_async(
        [
            f"link add {outside} type veth peer name eth0 netns {sandbox_pid}",
            f"link set {outside} master {BRIDGE}",
            f"link set {outside} up",
        ]
    )
    await run_ip_async(
        [
            "link set lo up",
            f"addr add {ip}/{prefix_len} dev eth0",
            "link set eth0 up",
            f"route add default via {gateway} dev eth0",
        ],
        netns_path(sandbox_pid),
    )


# ------------------------------------------------------------------------------------------ doors


class Doors:
    """``127.0.0.1:<port>`` on this machine, each forwarding TCP to one address inside the cluster network.

    The cluster network has no route to or from the machine, so processes outside it (tests, the demo)
    come in through these, as through ``kubectl port-forward``. A door's connections run on a thread
    of their own, so a busy caller never stalls them.
    """

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._doors: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-cluster-doors", daemon=True)
        self._thread.start()

    def open(self, host: str, port: int) -> tuple[str, int]:
        """The machine-side address that reaches ``host:port`` in the cluster network."""
        with self._lock:
            local = self._doors.get((host, port))
            if local is None:
                local = asyncio.run_coroutine_threadsafe(self._open(host, port), self._loop).result(30)
                self._doors[(host, port)] = local
        return "127.0.0.1", local

    async def _open(self, host: str, port: int) -> int:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._forward(host, port, reader, writer)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def _forward(
        self, host: str, port: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        sock = socket_in(self.netns)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout=10)
            server_r, server_w = await asyncio.open_connection(sock=sock)
        except (OSError, TimeoutError):
            sock.close()
            client_w.close()
            return
        await splice(client_r, client_w, server_r, server_w)

    def close(self) -> None:
        async def shut() -> None:
            for server in self._servers:
                server.close()

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


_SPLICING: set[asyncio.Task[object]] = set()


async def splice(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Copy both ways between two connections until both directions end, then close both."""
    # Held here while it runs: once one side half-closes, nothing the event loop holds leads to this
    # task (asyncio keeps a stream's reader only weakly), and a garbage collection would destroy it.
    task = asyncio.current_task()
    assert task is not None  # a coroutine awaited on a loop runs in a task
    _SPLICING.add(task)
    try:
        await asyncio.gather(_pipe(a_reader, b_writer), _pipe(b_reader, a_writer))
    finally:
        _SPLICING.discard(task)
        for writer in (a_writer, b_writer):
            with contextlib.suppress(OSError):
                writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        # Half-close: the other direction may still carry the answer.
        with contextlib.suppress(OSError):
            if writer.can_write_eof():
                writer.write_eof()
