"""What a hostile pod does to an HTTP port it can reach (metrics, health, status), on loopback only.

The attacker speaks from 127.0.0.1; a bystander (the Prometheus scraper) from 127.0.0.2: every address in
127.0.0.0/8 is local, and each is a peer of its own, as pods are.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

ATTACKER, BYSTANDER = "127.0.0.1", "127.0.0.2"
# Idle connections of the reported attack: more than a pod's pids.max of 300.
FLOOD = 310
# How long a trickling client is fed at most (far past any header deadline); never asserted on.
TRICKLE_S = 60.0


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def idle_flood(host: str, port: int, n: int = FLOOD, source: str = ATTACKER) -> list[socket.socket]:
    """``n`` connections that send nothing; those the server refused are open too (closed by it)."""
    conns: list[socket.socket] = []
    for _ in range(n):
        sock = socket.create_connection((host, port), timeout=5, source_address=(source, 0))
        conns.append(sock)
    return conns


def close_all(conns: list[socket.socket]) -> None:
    for sock in conns:
        with contextlib.suppress(OSError):
            sock.close()


def get(host: str, port: int, path: str, source: str = BYSTANDER, timeout: float = 30) -> tuple[int, bytes]:
    """One GET as a scraper sends it: status code and body."""
    with socket.create_connection((host, port), timeout=timeout, source_address=(source, 0)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def trickle(host: str, port: int, source: str = ATTACKER) -> bytes:
    """A slowloris: one byte of an endless header every 0.25 s. What the server answered before it closed the
    connection (b"" if it never did within :data:`TRICKLE_S`)."""
    with socket.create_connection((host, port), timeout=5, source_address=(source, 0)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        end = time.monotonic() + TRICKLE_S
        while time.monotonic() < end:
            try:
                sock.sendall(b"a")
            except OSError:
                break
            time.sleep(0.25)
            sock.setblocking(False)
            try:
                answer = sock.recv(4096)
            except BlockingIOError:
                answer = None
            except OSError:
                answer = b"closed"
            sock.setblocking(True)
            sock.settimeout(5)
            if answer is not None:
                return answer or b"closed"
    return b""
