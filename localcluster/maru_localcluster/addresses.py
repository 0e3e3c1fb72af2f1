"""Loopback addresses of one local cluster: pod IPs per node, Service ClusterIPs, the API server's.

Every address in ``127.0.0.0/8`` is local, so each pod can have its own address and two pods can
both listen on port 8000, as in a cluster where each pod has its own network namespace. A cluster
takes a whole ``127.<block>.0.0/16``; the block is held with a lock file for the cluster's life, so
clusters started at the same time on one machine (tests, a demo) never share an address. The lock
is released by the kernel when the process that holds it ends, however it ends.

Layout of a block ``B``::

    127.B.0.1          the API server's TLS front (what the ``kubernetes`` Service forwards to)
    127.B.<n>.0/24     pods of the n-th node (n = 1..200); 127.B.<n>.1 is the node's own address
    127.B.255.0/24     Service ClusterIPs (127.B.255.1 is the ``kubernetes`` Service)
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import itertools
import os
import random
import tempfile
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir()) / "maru-localcluster-blocks"
# 127.0.0.0/16 stays clear: 127.0.0.1 is everybody's localhost.
FIRST_BLOCK, LAST_BLOCK = 16, 250
MAX_NODES = 200
SERVICE_NET = 255


class AddressesExhausted(RuntimeError):
    pass


class AddressBlock:
    """One ``127.B.0.0/16`` held exclusively by this process until :meth:`release`."""

    def __init__(self, lock_dir: Path = LOCK_DIR) -> None:
        lock_dir.mkdir(parents=True, exist_ok=True)
        candidates = list(range(FIRST_BLOCK, LAST_BLOCK + 1))
        random.shuffle(candidates)
        for block in candidates:
            fd = os.open(lock_dir / f"{block}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EACCES, errno.EAGAIN):
                    continue
                raise
            self.block = block
            self._fd: int | None = fd
            break
        else:
            raise AddressesExhausted(f"every loopback block 127.{FIRST_BLOCK}-{LAST_BLOCK}.0.0/16 is taken")
        self._services = itertools.count(2)  # .1 is the kubernetes Service

    @property
    def api_server(self) -> str:
        return f"127.{self.block}.0.1"

    @property
    def kubernetes_service(self) -> str:
        return f"127.{self.block}.{SERVICE_NET}.1"

    def node_address(self, index: int) -> str:
        """The address of node ``index`` (1-based) itself."""
        return f"127.{self.block}.{_node_net(index)}.1"

    def pod_network(self, index: int) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"127.{self.block}.{_node_net(index)}.0/24")

    def next_service_ip(self) -> str:
        host = next(self._services)
        if host > 254:
            raise AddressesExhausted(f"no Service address left in 127.{self.block}.{SERVICE_NET}.0/24")
        return f"127.{self.block}.{SERVICE_NET}.{host}"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def _node_net(index: int) -> int:
    if not 1 <= index <= MAX_NODES:
        raise AddressesExhausted(f"node index {index} outside 1..{MAX_NODES}")
    return index


class PodAddresses:
    """Pod IPs of one node: .2 to .254 of its /24, handed out round-robin, never two live at once."""

    def __init__(self, network: ipaddress.IPv4Network) -> None:
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
        raise AddressesExhausted("no pod address left on this node")

    def keep(self, ip: str) -> None:
        """Mark an address as in use (pods found running when the kubelet starts)."""
        self._used.add(ip)

    def give_back(self, ip: str) -> None:
        self._used.discard(ip)
